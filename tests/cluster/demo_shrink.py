"""The shrunk demo the demo tests run: the mechanism, not the claim."""
from __future__ import annotations

# 3 tasks of 2 classes, one epoch, a 4-wide cnn4, pools cut to a few images per class
SHRINK = [
    "tasks.spec=2+2x2",
    "training.epochs=1",
    "training.batch_size=16",  # 8 per side: the 40 memory images are drawn without replacement, as in the demo
    "model.backbone_config={in_chans: 1, width: 4}",
    "pretrain=[{name: p1, pool: {dataset: glyphs, split: pretrain-1, options: {style: source}, per_class: 3}, "
    "num_classes: 100, epochs: 1, classifier: simplex}]",
    "replacements=[{at_task: 3, source: 'pretrain:p1'}]",
    "evaluation.query_set.per_class=2",
    "evaluation.gallery_set.per_class=2",
]
