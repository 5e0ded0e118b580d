"""A discrete-event simulator of a duet cluster: the real router on virtual time over simulated instances."""
