"""Per-namespace L2 usage read from the data itself, and explicit cleanup: a volume is scanned by
the agent beside each lmcache server (reached through agentclient), a Hugging Face bucket by the
operator (bucket); cleanup runs a gc for the controller and `kvpersist gc`."""
