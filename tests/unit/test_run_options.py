"""The options every run reads are declared once (hvdtrain.options.COMMON): an option added there
is a flag of `hvdtrain run` (and submit), a keyword of hvdtrain.run with its kind checked, a field
of RunRequest, and part of the run line `hvdtrain submit` writes, with no other edit."""

from __future__ import annotations

import json
import subprocess
import sys

ADDED = """
import dataclasses, json
from hvdtrain import options
added = options.RunOption("seed_offset", "--seed-offset", None, "A test's option.", "int", "int | None")
options.COMMON = (*options.COMMON, added)

import click
import hvdtrain
from hvdtrain import cli
from hvdtrain.cli import jobs
from hvdtrain.job.request import RunRequest, from_keywords
from hvdtrain.job.submit import run_argv

found = {
    "run_help": "--seed-offset INTEGER" in jobs.run.get_help(click.Context(jobs.run)),
    "submit_help": "--seed-offset" in jobs.submit.get_help(click.Context(jobs.submit)),
    "field": "seed_offset" in {f.name for f in dataclasses.fields(RunRequest)},
}
request = from_keywords("digits-mlp-torch", {"seed_offset": 3})
found["request"] = request.seed_offset
found["argv"] = run_argv(request)
parsed = jobs.run.make_context("run", list(found["argv"]), obj={"verbose": False})  # click consumes its list
found["parsed"] = parsed.params["seed_offset"]
found["default"] = from_keywords("digits-mlp-torch", {}).seed_offset
try:
    from_keywords("digits-mlp-torch", {"seed_offset": "three"})
except hvdtrain.UserError as error:
    found["refused"] = str(error)
print(json.dumps(found))
"""


def test_an_option_added_to_the_declaration_appears_in_the_cli_the_api_the_request_and_submit():
    done = subprocess.run([sys.executable, "-c", ADDED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["run_help"] and found["submit_help"] and found["field"]
    assert found["request"] == 3 and found["default"] is None
    assert found["argv"] == ["digits-mlp-torch", "--seed-offset", "3"] and found["parsed"] == 3
    assert found["refused"] == "seed_offset must be an int, got 'three'"
