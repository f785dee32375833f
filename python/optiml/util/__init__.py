"""Level 1: small helpers every other part may use (they import nothing of optiml but the native core).

atomic: output files that appear whole or not at all. sizes: byte sizes read and shown. memory: what the
operating system offers (available memory, transparent huge pages). paths: where OptiML keeps its files.
jsonout: JSON every parser reads (no NaN or Infinity: null).
"""
