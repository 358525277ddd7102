"""The status side: what a resource's status says, computed as pure functions of what was observed
(conditions), each lmcache server's own report (usage), and the watch caches of the operator's
workload objects (workloads). The controller's status loop feeds these and writes the result.
"""
