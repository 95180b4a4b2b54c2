"""Drafter training (`memra train` and the embedded models' build): the trainable drafter, its
losses, the online data step through memra's engine, checkpoints and export. The engine never
imports this package."""
