"""Multi-rank training over MPI. `world` says who this process is; it stays
rank 0 of 1 unless the train command runs under an MPI launcher with N > 1.

    mpi.py          launcher detection, MPI start, the abort-everyone excepthook,
                    attach(solver): consistency check, the strategy joins the solver's hooks
    allreduce.py    bucketed gradient allreduce overlapped with backward
    model_parallel.py  the model-parallel InnerProduct, a layer variant the factory picks
                    under a distributed context (registered when this package is imported)
    strategies.py   data parallel, hybrid (data + model parallel): solver Hooks
    split_db.py     one LMDB -> N shards `<prefix>_<r>` for split-DB training

`world` is this process's run context (caffepy.context.RunContext). The train
command calls `mpi.init_world()`, then builds the Solver with `context=world`;
the Solver hands it to the train net, whose layers read rank and size from it
(shared DB: rank r reads records r, r+N, ...; split DB: the source names
`{rank}`; the model-parallel InnerProduct). Nothing outside this package
imports it: layers and solvers only see their context.
"""
from ..context import RunContext


class World(RunContext):
    """This process's RunContext: rank 0 of 1 until mpi.init_world() fills it."""

    def __repr__(self):
        return f"<World rank {self.rank} of {self.size}>"


world = World()

# each rank's share of the cores, before the layer below imports the compiled kernels: OpenMP
# reads OMP_NUM_THREADS once, when it loads
from .mpi import share_cores  # noqa: E402
share_cores()
from . import model_parallel  # noqa: E402,F401  (registers the model-parallel InnerProduct)
