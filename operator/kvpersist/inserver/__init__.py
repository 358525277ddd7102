"""Code that runs inside the lmcache server's container, not in the operator.

The server image has lmcache and its dependencies but not kvpersist, so each module here is
standalone (standard library, lmcache, cryptography) and is rendered into the pod as source.
"""
