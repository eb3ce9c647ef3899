"""The run context: what a run tells the nets, layers and solvers it builds about itself.

Layers and solvers learn their rank, the number of ranks, the run's seed and how to agree on a
value (or add one up) across ranks from here, never by importing caffepy.parallel. A single process uses
`SINGLE`; a multi-rank run (caffepy.parallel.mpi.init_world) makes one around its communicator
and hands it to the Solver (`Solver(..., context=world)`), which hands it to its train net and
every layer in it. The test nets get the context the Solver's `test_context` names (the run's:
every rank tests its share of the batches).
"""


class RunContext:
    """rank of size; `comm` is the MPI communicator for code in caffepy.parallel (None alone)."""

    def __init__(self, rank=0, size=1, comm=None, seed=None):
        self.rank, self.size, self.comm, self.seed = rank, size, comm, seed

    @property
    def distributed(self):
        return self.size > 1

    def agree(self, value, root=0):
        """Every rank gets `root`'s value (a picklable Python object)."""
        if self.comm is None or self.size == 1:
            return value
        return self.comm.bcast(value, root=root)

    def total(self, value):
        """The sum of `value` (a number) over the ranks, on every rank. Every rank calls it at
        the same point."""
        if self.comm is None or self.size == 1:
            return value
        return self.comm.allreduce(value)

    def gather(self, value, root=0):
        """`root` gets every rank's value (a picklable Python object) in rank order; the
        other ranks get None. Every rank calls it at the same point."""
        if self.comm is None or self.size == 1:
            return [value]
        return self.comm.gather(value, root=root)

    def __repr__(self):
        return f"<RunContext rank {self.rank} of {self.size}>"


SINGLE = RunContext()
