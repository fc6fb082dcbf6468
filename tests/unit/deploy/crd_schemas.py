"""Structural JSON schemas for the two prometheus-operator CRDs we ship (monitoring.coreos.com/v1
ServiceMonitor and PrometheusRule). Hand-written from the operator's API reference for the fields
these manifests may use; unknown fields are rejected at every level we populate, so a typo fails.
kubernetes-validate has no CRD schemas, hence this subset."""

from __future__ import annotations

from typing import Any

_STR = {"type": "string"}
# Prometheus duration, as the CRD's own pattern: 1h30m, 15s, 500ms
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_LABELS = {"type": "object", "additionalProperties": _STR}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _STR, "namespace": _STR, "labels": _LABELS, "annotations": _LABELS},
    "additionalProperties": False,
}
_LABEL_SELECTOR = {
    "type": "object",
    "properties": {
        "matchLabels": _LABELS,
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "required": ["key", "operator"],
            "properties": {"key": _STR, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                           "values": {"type": "array", "items": _STR}},
            "additionalProperties": False}},
    },
    "additionalProperties": False,
}
_RELABEL = {
    "type": "object",
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "separator": _STR, "targetLabel": _STR, "regex": _STR, "modulus": {"type": "integer"},
        "replacement": _STR,
        "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
                            "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep",
                            "lowercase", "Lowercase", "uppercase", "Uppercase", "keepequal", "KeepEqual",
                            "dropequal", "DropEqual"]},
    },
    "additionalProperties": False,
}
_SECRET_KEY = {"type": "object", "required": ["key"], "properties": {
    "name": _STR, "key": _STR, "optional": {"type": "boolean"}}, "additionalProperties": False}
_SECRET_OR_CONFIGMAP = {"type": "object", "properties": {"secret": _SECRET_KEY, "configMap": _SECRET_KEY},
                        "additionalProperties": False}
# Endpoint.tlsConfig (TLSConfig: SafeTLSConfig and the file paths) and Endpoint.basicAuth (BasicAuth)
_TLS_CONFIG = {"type": "object", "properties": {
    "ca": _SECRET_OR_CONFIGMAP, "cert": _SECRET_OR_CONFIGMAP, "keySecret": _SECRET_KEY, "serverName": _STR,
    "insecureSkipVerify": {"type": "boolean"}, "caFile": _STR, "certFile": _STR, "keyFile": _STR,
    "minVersion": {"enum": ["TLS10", "TLS11", "TLS12", "TLS13"]},
    "maxVersion": {"enum": ["TLS10", "TLS11", "TLS12", "TLS13"]}},
    "additionalProperties": False}
_BASIC_AUTH = {"type": "object", "properties": {"username": _SECRET_KEY, "password": _SECRET_KEY},
               "additionalProperties": False}
_ENDPOINT = {
    "type": "object",
    "properties": {
        "tlsConfig": _TLS_CONFIG, "basicAuth": _BASIC_AUTH,
        "port": _STR, "targetPort": {"oneOf": [_STR, {"type": "integer"}]}, "path": _STR,
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]}, "interval": _DURATION, "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"}, "honorTimestamps": {"type": "boolean"},
        "relabelings": {"type": "array", "items": _RELABEL},
        "metricRelabelings": {"type": "array", "items": _RELABEL},
    },
    "additionalProperties": False,
}

SERVICE_MONITOR: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {"type": "object", "properties": {
                    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STR}},
                    "additionalProperties": False},
                "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
                "jobLabel": _STR,
                "targetLabels": {"type": "array", "items": _STR},
                "podTargetLabels": {"type": "array", "items": _STR},
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}

_RULE = {
    "type": "object",
    "required": ["expr"],
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "properties": {
        "alert": _STR, "record": _STR, "expr": {"type": ["string", "integer"]}, "for": _DURATION,
        "keep_firing_for": _DURATION, "labels": _LABELS, "annotations": _LABELS,
    },
    "additionalProperties": False,
}

PROMETHEUS_RULE: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "properties": {
                "groups": {"type": "array", "items": {
                    "type": "object", "required": ["name", "rules"],
                    "properties": {"name": _STR, "interval": _DURATION, "limit": {"type": "integer"},
                                   "rules": {"type": "array", "items": _RULE}},
                    "additionalProperties": False}},
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}

CRD_SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR, "PrometheusRule": PROMETHEUS_RULE}
