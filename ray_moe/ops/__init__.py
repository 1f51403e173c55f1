"""Operations: certify a cluster before a run (``ray-moe smoke``), per-node probes, the
rank-to-rank bandwidth matrix."""
