"""Recovery of a run: failure causes, the failure policy, the state machine, rolling back."""
