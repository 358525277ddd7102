"""The controller: the kopf handlers, one module per role, registered by importing handlers, and
what they remember (state) and act on. docs/design.md's module map says which module holds what.
"""
