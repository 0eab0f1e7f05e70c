"""`python -m hvdtrain.data digits-png|digits-jpeg DIR [--copies N]`: a folder to train
image-folder-torch or image-folder-tf on."""

from __future__ import annotations

from pathlib import Path

from hvdtrain.data import write_digits_images


def main(argv: list[str] | None = None) -> int:
    """`python -m hvdtrain.data digits-png|digits-jpeg DIR [--copies N]`: a folder to train
    image-folder-torch or image-folder-tf on."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hvdtrain.data")
    parser.add_argument("what", choices=["digits-png", "digits-jpeg"])
    parser.add_argument("root", type=Path)
    parser.add_argument("--copies", type=int, default=1, help="Each training image this many times.")
    args = parser.parse_args(argv)
    if args.copies < 1:
        parser.error("--copies must be at least 1")
    counts = write_digits_images(args.root, args.copies, suffix={"digits-png": ".png"}.get(args.what, ".jpg"))
    print(f"wrote {counts['train']:,} training and {counts['test']:,} test images under {args.root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
