"""In-memory snapshots, the whole feature in one package.

The worker side: a rank copies its :class:`~resilient_rl.workers.rank_state.RankState` into host
memory (:mod:`.take`, packed by :mod:`.buffers`, its plain parts by :mod:`.state`), into node
memory where it outlives the process (:mod:`.node_memory`, sized by :mod:`.node_capacity`, swept
by :mod:`.node_sweep`, checksummed JSON metadata in :mod:`.meta`), keeps its ring peers' copies
and loads a copy back (:mod:`.restore`); :mod:`.slots` holds the locks of its threads. These
are parts of a stateful role worker, built together by :mod:`.parts`.

The controller side: the keeper (:mod:`.keeper`, each snapshot tracked as a :mod:`.tracked`
one) decides when and where to take them (sizing in
:mod:`.sizing`, ring peers in :mod:`.ring`), loads the newest usable one into every rank after a
failure (:mod:`.loading`; recovery's roll-back calls it) and records them for a next controller
(:mod:`.carry`).
"""
