"""The status side: pure functions from what was observed (conditions), each lmcache server's report
(usage) and the watch caches of the operator's workloads (workloads); the status loop writes the result."""

Verdict = tuple[bool | None, str, str]  # (status, reason, message), as conditions.condition takes them
