"""Horovod's API over the reduction server: a Horovod script runs by changing its import.

    import reduction_server.client.horovod.torch as hvd        # horovod.torch
    import reduction_server.client.horovod.tensorflow as hvd   # horovod.tensorflow
    import reduction_server.client.horovod.keras as hvd        # horovod.tensorflow.keras

This package holds the core the framework packages share (collectives matched across ranks by
name, negotiated every HOROVOD_CYCLE_TIME and fused up to HOROVOD_FUSION_THRESHOLD); its modules:
docs/design.md, "Where each concept lives".
"""
