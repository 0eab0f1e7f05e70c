"""What every launch shares, whichever launcher or strategy starts the ranks: the launch spec and
command (spec), the one place a command runs and is reaped (runner), reading what ranks print
(rank_output) and showing it (console), other hosts over ssh or a Slurm step (remote), and the
engines a job runs on: containers, Slurm allocations, Kubeflow's MPI Operator."""
