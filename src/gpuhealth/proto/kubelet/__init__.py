"""Kubelet PodResources v1 API: ``api.proto`` and its generated modules (imported only by
``gpuhealth.agent.attribution`` when a kubelet socket is present; needs the grpc extra)."""
