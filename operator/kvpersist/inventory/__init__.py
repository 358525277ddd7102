"""The inventory subsystem: per-namespace L2 usage read from the data itself, and explicit cleanup.
The volume scan (volume) runs in the agent beside each lmcache server and is reached through
agentclient; a Hugging Face bucket is scanned from the operator (bucket, hfbucket's preflight).
cleanup decides and runs a gc for the controller and `kvpersist gc`.
"""
