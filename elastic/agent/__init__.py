"""The agent side: everything that runs in the ``elastic-run`` process of each node.

Never imports torch (a test proves it): what needs torch runs in helper processes (the
round's store, the fork server) or in the workers.

    main         the command: parse, check, launch
    args         the command line (torchrun's flags and ours)
    config       the checked RunConfig
    launch       wires one node together
    signals      the agent's signals, handed on by a relay thread (a lock in a handler hangs)
    core         the decision table: (state, event) -> reaction, pure
    loop         the agent loop: gathers events, carries out reactions
    workers      the local worker processes (start, poll, drain, hold, stop)
    placement    a worker's torchrun environment (and torchrun's restart count)
    lobby        a newcomer's workers started before it joins (pure; tripwire: theirs)
    resumed      whether a round trains committed steps again (pure): never silent
    handover     whether a node told to leave first hands the newest state over (pure)
    handing      that handover's wait: the signal held back and its timer
    procs        process groups that never outlive the agent
    helper       the helper processes' common base (socket pair, session, ready)
    forkserver   --start-method forkserver (zygote: its process)
    storehost    the round's TCPStore (store_server: its process)
    logs         worker output: console, files, attempts
    failures     worker failures and the root-cause report
    hangs        when a silent worker is hung, learned from its own steps (pure)
    filetimer    torch's file timer (TORCHELASTIC_ENABLE_FILE_TIMER)
    breakdown    the node's newest snapshot saved when the job or the node ends
    etcd_plan    which etcd the job uses, decided (pure); job_etcd: its I/O
    etcd_server  the embedded etcd
    metrics      /metrics and /healthz (collectors: workers via psutil, GPUs via NVML)
    nodedir      the node's shared-memory directory
    devices      GPUs and --nproc-per-node
"""
