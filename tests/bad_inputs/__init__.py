"""The bad-input corpus: malformed files and arguments, each run through the caffepy command.

    corpus.py   the fixtures (a small LMDB, nets, weights, a solver, a mean, images) and the
                cases, by category, each a function writing its inputs and returning its argv
    runner.py   runs a batch of cases, each in a process forked from one warmed-up interpreter

tests/test_bad_inputs.py runs the corpus and checks every case: the exit code, exactly one
error line (no traceback, no signal), what that line names, and that nothing was left
written.
"""
