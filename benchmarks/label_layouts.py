"""Labels-only copies of the CelebA and CASIA-WebFace layouts at their published sizes, for ``compat plan``'s cost.

``compat plan`` counts the images every stage's sampler processes from the pools' labels; it never decodes an image.
This writes the files the readers list (CelebA's two text files, CASIA's identity folders with empty ``.jpg`` files)
at the published counts, identities spread as evenly as the totals allow (the published per-identity counts vary;
with ``replay.epoch_length: reference`` an epoch depends only on each task's total and the memory):

    python benchmarks/label_layouts.py /tmp/layouts
    compat plan configs/iam-cl2r-celeba-dinov3-t16.yaml --set data.root=/tmp/layouts/celeba \\
        --set evaluation.query_set.root=/tmp/layouts/celeba --set evaluation.gallery_set.root=/tmp/layouts/celeba \\
        --set 'pretrain[0].pool.root=/tmp/layouts/casia' ... --seconds-per-image 0.000886
"""
from __future__ import annotations

import argparse
import os

# CelebA: 202,599 images of 10,177 identities; partition 0/1/2 = 162,770 / 19,867 / 19,962 images of 8,192 / 985 /
# 1,000 disjoint identities. CASIA-WebFace: 494,414 images of 10,575 identities.
CELEBA_PARTITIONS = ((162_770, 8_192), (19_867, 985), (19_962, 1_000))
CASIA = (494_414, 10_575)


def _spread(images: int, identities: int) -> list[int]:
    """Images per identity, as even as ``images`` / ``identities`` allows (the larger counts first)."""
    base, extra = divmod(images, identities)
    return [base + 1] * extra + [base] * (identities - extra)


def write_celeba(root: str, partitions=CELEBA_PARTITIONS) -> str:
    """CelebA's identity_CelebA.txt and list_eval_partition.txt (and an empty img_align_celeba/) under ``root``."""
    os.makedirs(os.path.join(root, "img_align_celeba"), exist_ok=True)
    identity_lines, partition_lines = [], []
    number, identity = 0, 0
    for code, (images, identities) in enumerate(partitions):
        for count in _spread(images, identities):
            identity += 1
            for _ in range(count):
                number += 1
                identity_lines.append(f"{number:06d}.jpg {identity}")
                partition_lines.append(f"{number:06d}.jpg {code}")
    with open(os.path.join(root, "identity_CelebA.txt"), "w") as handle:
        handle.write("\n".join(identity_lines) + "\n")
    with open(os.path.join(root, "list_eval_partition.txt"), "w") as handle:
        handle.write("\n".join(partition_lines) + "\n")
    return root


def write_casia(root: str, images: int = CASIA[0], identities: int = CASIA[1]) -> str:
    """CASIA-WebFace's folder layout (one folder per identity of empty .jpg files) under ``root``."""
    for index, count in enumerate(_spread(images, identities)):
        folder = os.path.join(root, f"{index:07d}")
        os.makedirs(folder, exist_ok=True)
        for number in range(count):
            open(os.path.join(folder, f"{number:03d}.jpg"), "wb").close()
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="folder to write celeba/ and casia/ into")
    args = parser.parse_args()
    print(write_celeba(os.path.join(args.root, "celeba")))
    print(write_casia(os.path.join(args.root, "casia")))


if __name__ == "__main__":
    main()
