"""Multi-rank training over MPI. `world` says who this process is; it stays
rank 0 of 1 unless the train command runs under an MPI launcher with N > 1.

    mpi.py          launcher detection, MPI start, the abort-everyone excepthook,
                    attach(solver): consistency check, weight broadcast, strategy
    allreduce.py    bucketed gradient allreduce overlapped with backward
    strategies.py   data parallel, model-parallel InnerProduct, hybrid
    split_db.py     one LMDB -> N shards `<prefix>_<r>` for split-DB training

Data layers read `world.rank` / `world.size` at setup (shared DB: rank r reads
records r, r+N, ...; split DB: the source names `{rank}`), so the train command
calls `mpi.init_world()` before it builds any net.
"""
from ..context import RunContext


class World(RunContext):
    """This process's RunContext: rank 0 of 1 until mpi.init_world() fills it."""

    def __repr__(self):
        return f"<World rank {self.rank} of {self.size}>"


world = World()
