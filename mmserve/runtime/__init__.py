"""What runs a stage and reports it: the step loop thread, its torch threads, metrics, wire formats."""
