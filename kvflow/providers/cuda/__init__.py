"""GPU memory on the data path: copy engines (copier.py) and the staging
pipeline through bounded host bounce buffers (staging.py), which carry
GPU memory over every host provider (tcp, rdma, local). Nothing here
imports CUDA until a CUDA copy engine is made."""
