"""What every rank runs: `python -m hvdtrain.worker --recipe SPEC --run-dir DIR --config JSON
[--resume]`, or `python -m hvdtrain.worker --script PATH -- ARGS...` (`--module NAME -- ARGS...`) for a
user's own training script.
SPEC is what registry.load takes (a recipe's name, a recipe file's absolute path, or module:pkg.mod),
so a rank loads the recipe the CLI planned, the same way.

The CLI resolves and validates the config before any rank starts and passes it in the command, so
ranks on other hosts need no shared disk; a rank only parses it, picks the strategy's backend and
trains. A script runs as `python PATH ARGS...` (`python -m NAME ARGS...`) would, with its arguments
intact. Both run under the stall watchdog.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import re
import runpy
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from hvdtrain import config as config_module
from hvdtrain import registry, strategies
from hvdtrain.errors import (
    EXIT_INCONSISTENT_WEIGHTS,
    EXIT_USAGE,
    EXIT_WRITE_FAILED,
    INCONSISTENT_WEIGHTS,
    INPUT_ERROR,
    TRACEBACK_FOLLOWS,
    InputError,
)
from hvdtrain.runtime import checkpoint, checkpoint_write, divergence, preempt, watchdog
from hvdtrain.runtime.imports import collector_off, import_tensorflow_without_extras

PEER_FAILED = re.compile(
    r"Horovod has been shut down|Connection (?:closed|reset) by peer|Broken pipe|HorovodInternalError"
)
"""What a collective raises here when another rank went away (Horovod's torch and TensorFlow ops)."""
PEER_FAILED_LINGER_S = 3.0
"""How long a rank whose collective failed because of another rank waits before it exits: the
launcher names the first rank to exit, and that should be the one that failed, not its peers."""


def peer_failed(error: BaseException) -> bool:
    """Whether an exception, or one it came from, is a collective failing because a peer is gone."""
    seen: BaseException | None = error
    while seen is not None:
        if type(seen).__name__ == "HorovodInternalError" or PEER_FAILED.search(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def run_script(path: str, script_args: list[str]) -> int:
    sys.argv = [path, *script_args]
    sys.path.insert(0, str(Path(path).resolve().parent))
    runpy.run_path(path, run_name="__main__")
    return 0


def run_module(name: str, script_args: list[str]) -> int:
    """As `python -m NAME ARGS...` would: the working directory first on sys.path (`python -m
    hvdtrain.worker` put it there), argv[0] the module's file."""
    sys.argv = [name, *script_args]
    runpy.run_module(name, run_name="__main__", alter_sys=True)
    return 0


def threads_here(environ: dict[str, str], cores: int) -> dict[str, str]:
    """HVDTRAIN_THREADS_PER_RANK=auto (ranks on several hosts): this host's cores shared by the ranks
    the launcher put here, worked out on the host itself before a framework starts its thread pools."""
    if environ.get("HVDTRAIN_THREADS_PER_RANK") != "auto":
        return {}
    from hvdtrain import launchers  # each launcher names its local-size variable

    threads = str(max(1, cores // max(1, launchers.local_size(environ))))
    return {"HVDTRAIN_THREADS_PER_RANK": threads, "OMP_NUM_THREADS": threads}


def import_framework(framework: str) -> None:
    """The recipe's framework and hvdtrain's runtime for it, before the strategy trains, with the
    garbage collector off (hvdtrain.runtime.imports)."""
    with collector_off():
        if framework == "tensorflow":
            import_tensorflow_without_extras()
        importlib.import_module(f"hvdtrain.runtime.{framework}")


def main(argv: list[str] | None = None, whole_process: bool = False) -> int:
    """A rank's training; `whole_process`: this process is the rank and nothing else (not a Ray
    actor), so it may end with os._exit once its results are written (Strategy.finalize)."""
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # srun's wrapper ignores it for its own sake
    script = argv[:1] in (["--script"], ["--module"])
    if script:  # a script cannot agree on a step to stop at: the warning is not its
        signal.signal(preempt.SIGNAL, signal.SIG_IGN)
    else:
        preempt.install()
    os.environ.update(threads_here(dict(os.environ), len(os.sched_getaffinity(0)) or 1))
    dog = watchdog.start_from_env()
    if script:
        rest = argv[2:]
        run = run_script if argv[0] == "--script" else run_module
        return run(argv[1], rest[1:] if rest[:1] == ["--"] else rest)
    parser = argparse.ArgumentParser(prog="hvdtrain.worker")
    parser.add_argument("--recipe", required=True, help="A name, a recipe file, or module:pkg.mod.")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--strategy", default="horovod")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--config", help="The run's config as JSON, as the CLI resolved it.")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=None,
        help="Build the config here from the recipe and these overrides (a Kubernetes MPIJob).",
    )
    args = parser.parse_args(argv)

    try:
        recipe = registry.load(args.recipe)
    except ValueError as error:  # e.g. a recipe file missing on this host: one line, not a traceback
        print(f"{INPUT_ERROR} {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.config is not None:
        config = config_module.from_dict(recipe.config, json.loads(args.config))
    else:
        config = config_module.apply(
            recipe.make_config(), config_module.parse_overrides(recipe.config, args.overrides or [])
        )
    strategy = strategies.get(args.strategy, recipe.framework)
    ends_by_os_exit = whole_process and strategy.finalize is not None
    scratch = own_temporary_folder() if ends_by_os_exit and recipe.framework == "tensorflow" else None
    import_framework(recipe.framework)
    try:
        summary = strategy.train(recipe, config, args.run_dir, args.resume)
    except (
        preempt.Preempted,
        divergence.Diverged,
    ):  # every rank stopped at one step, as rank 0's marker says
        summary = {"weights_consistent": True}
    except InputError as error:  # the input's fault, not the code's: one line, the traceback in the log
        # one write: a launcher that tags what it reads in pieces gets it in as few as it can
        text = f"{TRACEBACK_FOLLOWS}\n{traceback.format_exc()}{INPUT_ERROR} {InputError.line_of(error)}\n"
        sys.stderr.write(text)
        sys.stderr.flush()
        return EXIT_USAGE
    except checkpoint_write.WriteFailed as error:  # the disk's fault, not the code's: one line
        print(f"{checkpoint.WRITE_FAILED} {error}", file=sys.stderr, flush=True)
        return EXIT_WRITE_FAILED
    except Exception as error:
        if not peer_failed(error):
            raise
        # a consequence, not a cause: the failed rank's own lines say what happened
        first = (str(error).splitlines() or [""])[0]
        print(
            f"hvdtrain: a collective ended because another rank did ({type(error).__name__}: {first[:160]})",
            file=sys.stderr,
            flush=True,
        )
        terminated = preempt.terminated()
        preempt.uninstall()
        if not terminated:  # else the launcher is ending the job already, and named the failed rank
            time.sleep(PEER_FAILED_LINGER_S)  # the launcher usually ends this rank sooner
        return 1
    finally:
        preempt.uninstall()
    code = 0
    if not summary["weights_consistent"]:
        print(f"{INCONSISTENT_WEIGHTS} ({args.run_dir})", file=sys.stderr)
        code = EXIT_INCONSISTENT_WEIGHTS
    if ends_by_os_exit:
        strategy.finalize(recipe.framework)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        sys.stdout.flush()
        sys.stderr.flush()
        if dog is not None:
            dog.beat(ended=True)  # os._exit skips atexit's
        os._exit(code)
    return code


def own_temporary_folder() -> str:
    """A folder of this rank's own for Python's temporary files, which the rank removes before its
    os._exit: TensorFlow's autograph writes every function it converts to a temporary file that only
    an atexit handler removes, which os._exit skips (dozens a run, left in /tmp). A rank that returns
    (an error) removes it at exit; one killed, or ended by the stall watchdog's os._exit, leaves this
    one folder behind."""
    folder = tempfile.mkdtemp(prefix="hvdtrain-rank-")
    tempfile.tempdir = folder
    atexit.register(shutil.rmtree, folder, True)
    return folder


if __name__ == "__main__":
    sys.exit(main(whole_process=True))
