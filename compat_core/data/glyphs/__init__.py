"""The offline many-class glyph set rendered from matplotlib's fonts: catalogue, fonts, rendering and the dataset reader."""
