"""The run's single-writer leases, in one place.

- :mod:`.claims`: one claim file: its JSON format and who wrote it (host, pid, start time).
- :mod:`.run_lease`: :class:`~.run_lease.RunLease`, a lease on one folder: the claims with
  fencing tokens, renewal, expiry, the takeover of a dead holder's lease, release.
- :mod:`.run_claim`: :class:`~.run_claim.RunClaim`, a controller's claim on a run: a lease on the
  run folder and one on the checkpoint folder, taken before anything of the run is written.
"""
