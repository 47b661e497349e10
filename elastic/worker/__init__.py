"""The worker side: the API a training script uses, running in the training processes.

Imports torch; knows nothing of etcd. It talks to its agent only through
``elastic.contract`` (environment variables and the control block).

    state        elastic.State: the facade a script uses (commit, restore, run)
    group        the process group a live worker re-forms in place (its one owner)
    roundstore   the round's store as a re-forming worker uses it: waits an abandon ends
    stuck        whether a worker asked to leave its group never will (pure)
    comm         the few collectives State itself needs, on its own gloo group
    snapshotter  snapshots into the node's shared memory, copied in the background
    pinning      the slots page-locked for CUDA, so GPU tensors reach them by DMA
    snapshot     the snapshot format (tensors plus a skeleton)
    cadence      how often to snapshot, from measured step and snapshot costs
    agreement    at which steps the ranks agree, from measured step and agreement costs
    doorbell     whether to agree, asked inside DDP's gradient all-reduce
    restore      finding the newest state in the job and loading it
    rng          random number generator states
    sharded      FSDP2/DTensor state through torch.distributed.checkpoint
    reshard      FSDP2/HSDP state re-sharded in memory when a live group re-forms
    reshard_plan who sends which rows to whom (pure)
    sampler      ElasticSampler and BatchPolicy
    progress     training progress for the agent's /metrics
    alive        the process's sign of life apart from progress (frozen vs blocked)
    placed       whether a worker started ahead read its ranks before it was placed
    finalize     the default group the script leaves, destroyed at exit
    quick_exit   the heap frozen at exit: Python's exit walks none of torch's objects
"""
