"""Local processes: the Spaces run as child processes on this machine.

Owns starting, health-checking and stopping the Wordle server, the vLLM replica and the dashboard
(``children``), the loopback ports they are given (``ports``), how the CPU cores are shared
between the trainer and its replicas (``threads``), polling a replica for the version it serves
(``replica_poll``), where library logs go (``log_policy``), and the end-to-end journey with its
injected faults (``e2e``, ``make e2e``).
"""
