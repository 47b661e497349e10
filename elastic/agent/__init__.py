"""The agent side: everything that runs in the ``elastic-run`` process of each node.

Never imports torch (a test proves it): what needs torch runs in helper processes (the
round's store, the fork server) or in the workers.

    main        the command: parse, check, launch
    args        the command line (torchrun's flags and ours)
    config      the checked RunConfig
    launch      wires one node together
    core        the decision table: (state, event) -> reaction, pure
    loop        the agent loop: gathers events, carries out reactions
    workers     the local worker processes (start, poll, drain, stop)
    placement   a worker's torchrun environment
    procs       process groups that never outlive the agent
    forkserver  --start-method forkserver (zygote: its process)
    storehost   the round's TCPStore (store_server: its process)
    logs        worker output: console, files, attempts
    failures    worker failures and the root-cause report
    etcd_server the embedded etcd
    metrics     /metrics and /healthz (collectors: workers via psutil, GPUs via NVML)
    nodedir     the node's shared-memory directory
    devices     GPUs and --nproc-per-node
"""
