"""The centralised track: one-node methods registered under :data:`fedsim.registry.CENTRAL`.

Each method registers itself when its module is imported; :data:`fedsim.plugins.BUILTINS` says which,
so importing this package imports no method (nor torch, transformers, ...).
"""
