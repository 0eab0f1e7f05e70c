"""What every rank runs: `python -m hvdtrain.worker --recipe NAME --run-dir DIR [--resume]`,
or `python -m hvdtrain.worker --script PATH -- ARGS...` for a user's own training script.

The CLI resolves and validates the config before any rank starts and leaves it in
RUN_DIR/config.json; a rank only loads it, picks the strategy's backend and trains. A script runs
as `python PATH ARGS...` would, with its arguments intact. Both run under the stall watchdog.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from hvdtrain import config as config_module
from hvdtrain import registry, strategies
from hvdtrain.runtime import watchdog
from hvdtrain.runtime.common import EXIT_INCONSISTENT_WEIGHTS


def run_script(path: str, script_args: list[str]) -> int:
    sys.argv = [path, *script_args]
    sys.path.insert(0, str(Path(path).resolve().parent))
    runpy.run_path(path, run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    watchdog.start_from_env()
    if argv and argv[0] == "--script":
        rest = argv[2:]
        return run_script(argv[1], rest[1:] if rest[:1] == ["--"] else rest)
    parser = argparse.ArgumentParser(prog="hvdtrain.worker")
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--strategy", default="horovod")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=None,
        help="Build the config here from the recipe and these overrides instead of reading "
        "RUN_DIR/config.json (pods on a cluster share no file system).",
    )
    args = parser.parse_args(argv)

    recipe = registry.get(args.recipe)
    if args.overrides is None:
        config = config_module.load(recipe.config, args.run_dir / "config.json")
    else:
        config = config_module.apply(
            recipe.make_config(), config_module.parse_overrides(recipe.config, args.overrides)
        )
    strategy = strategies.get(args.strategy, recipe.framework)
    summary = strategy.train(recipe, config, args.run_dir, args.resume)
    if not summary["weights_consistent"]:
        print(f"hvdtrain: ranks ended with different weights ({args.run_dir})", file=sys.stderr)
        return EXIT_INCONSISTENT_WEIGHTS
    return 0


if __name__ == "__main__":
    sys.exit(main())
