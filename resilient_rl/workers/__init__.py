"""The four roles (actor, critic, ref, rollout) and FSDP2 wrapping."""
