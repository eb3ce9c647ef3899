"""Multi-rank training over MPI. `world` says who this process is; it stays
rank 0 of 1 unless the train command runs under an MPI launcher with N > 1."""


class World:
    rank = 0
    size = 1
    comm = None      # an mpi4py communicator when size > 1


world = World()
