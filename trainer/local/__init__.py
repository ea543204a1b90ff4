"""Local processes: the Spaces run as child processes on this machine.

Owns starting, health-checking and stopping the Wordle server, the vLLM replica and the dashboard
(``processes``), and the end-to-end journey with its injected faults (``e2e``, ``make e2e``).
"""
