"""What a job did and does: events, metrics, the live status view, the timeline picture, the log format.

One module per concern: :mod:`.events` (the event model, pure),
:mod:`.sink` (a process's emitter: torch's elastic events and the run's
bounded event log in etcd, :mod:`elastic_ft.etcd.event_log`),
:mod:`.metrics` (the agent's optional Prometheus endpoint), :mod:`.live`
(``elastic-ft status --watch``), :mod:`.timeline` (``elastic-ft
timeline``) and :mod:`.log_format` (the one log format of every process).
"""
