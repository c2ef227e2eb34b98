"""Two heatmaps side by side: the left picture's pixels, a white gap, the right picture's pixels."""
from __future__ import annotations

import numpy as np
from PIL import Image

from pipelines.reports.picture_grid import side_by_side


def test_pictures_are_placed_left_to_right_top_aligned(tmp_path):
    Image.new("RGB", (30, 20), (255, 0, 0)).save(tmp_path / "a.png")
    Image.new("RGB", (10, 40), (0, 0, 255)).save(tmp_path / "b.png")
    out = side_by_side([tmp_path / "a.png", tmp_path / "b.png"], tmp_path / "out" / "both.png", gap=5)
    pixels = np.asarray(Image.open(out))
    assert pixels.shape == (40, 45, 3)
    assert (pixels[:20, :30] == [255, 0, 0]).all() and (pixels[20:, :30] == 255).all()  # white below the shorter
    assert (pixels[:, 30:35] == 255).all()
    assert (pixels[:, 35:] == [0, 0, 255]).all()
