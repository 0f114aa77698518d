"""The coordination protocol both sides share, on any ``torch.distributed.Store``.

The Wrapper's ranks and their monitor processes (the worker side) and
``ftrun``'s agent (the node side) coordinate only through a store: barriers
(:mod:`.barriers`), the records of one restart iteration (:mod:`.iteration`),
the job-wide records by initial rank (:mod:`.job`), and reports of dead
processes from outside (:mod:`.reports`). Both sides import this package;
it imports neither, so the node side loads nothing of the worker side.
Every key name comes from :mod:`elastic_ft.keys`; every value is plain
text or JSON, never pickled.
"""
