"""memra's engine: config, checkpoints, census, policy, quantization, models and the round loop.

Importable without the CLI; library code never prints (it returns data or logs).
"""
