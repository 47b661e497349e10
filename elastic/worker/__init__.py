"""The worker side: the API a training script uses, running in the training processes.

Imports torch; knows nothing of etcd. It talks to its agent only through
``elastic.contract`` (environment variables and the control block).

    state       elastic.State: the facade a script uses (commit, restore)
    snapshotter snapshots into the node's shared memory, copied in the background
    slots       the two shared-memory slots a snapshot goes to
    snapshot    the snapshot format (tensors plus a skeleton)
    restore     finding the newest state in the job and loading it
    rng         random number generator states
    checkpoint  durable checkpoint files
    sharded     FSDP2/DTensor state through torch.distributed.checkpoint
    sampler     ElasticSampler and BatchPolicy
    progress    training progress for the agent's /metrics
"""
