"""What the tests import: the namespace-host rig and the helpers that start and inspect runs."""
