"""What a process of the job needs of its host and its torch, whichever side it is on.

``reaper`` ends the processes a process started when it dies; ``local_board``
is the shared memory a node's agent and its workers read; ``torch_compat``
holds every use of torch's internals, checked against the supported
versions; ``lazy`` imports a module on first use; ``net`` finds a free port.
Nothing here imports the rest of the package.
"""
