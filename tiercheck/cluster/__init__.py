"""How the ranks of a job work together: ``coordination`` (sans-I/O protocols over the job's
key-value store, driven for one rank or in lockstep for thousands of simulated ones), ``lock`` (one
writer per local directory) and ``assign`` (which rank writes, and which reads, each chunk)."""
