"""Validation of emitted envelopes against the official WS-RM and WS-Addressing schemas, offline.

The schemas' ``xs:import`` elements point at network locations; ``load_schemas`` rewrites each one to the
local copy of the imported file before compiling, and parses with ``no_network=True``, so nothing is ever
fetched. There is no SOAP envelope schema here: each WS-RM and WS-Addressing element under Header and Body
(and the wsrm:Identifier inside a fault's Detail) is validated on its own, as the WS-RM specs suggest.

WS-MakeConnection elements (MakeConnection in the Body, MessagePending in the Header) are validated against
the WS-MC schema, which exists for WS-RM 1.1 with WS-Addressing 2005/08 only; its MakeConnection lets elements
of other namespaces through unchecked (``processContents="lax"``), so the wsrm:Identifier a MakeConnection may
hold is validated against the WS-RM 1.1 schema on its own.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lxml import etree

from qtp.wsrm.codec._names import RM_NS, SOAP_BY_NS, WSA_NS, WSMC_NS, WsaVersion
from qtp.wsrm.protocol import RMVersion

# (WS-RM version, WS-Addressing version) -> (WS-RM schema file, the addressing schema it imports)
SCHEMA_FILES = {
    (RMVersion.WSRM10, WsaVersion.WSA200408): ("metro-wsrm-200502.xsd", "ws-addr-2004-08.xsd"),
    (RMVersion.WSRM10, WsaVersion.WSA200508): ("cxf-wsrm-1.0-wsa15.xsd", "ws-addr-2005-08.xsd"),
    (RMVersion.WSRM11, WsaVersion.WSA200508): ("metro-wsrm-200702.xsd", "ws-addr-2005-08.xsd"),
}
WSMC_SCHEMA_FILE = "metro-wsmc-200702.xsd"  # WS-MakeConnection 1.1, with WS-RM 1.1 and WS-Addressing 2005/08
_WSMC_VERSIONS = (RMVersion.WSRM11, WsaVersion.WSA200508)
_XS = "http://www.w3.org/2001/XMLSchema"


def _parser() -> etree.XMLParser:
    return etree.XMLParser(no_network=True, resolve_entities=False)


def load_schema(directory: Path, rm_file: str, wsa_file: str) -> etree.XMLSchema:
    document = etree.parse(str(directory / rm_file), _parser())
    for imported in document.getroot().iter(f"{{{_XS}}}import"):
        imported.set("schemaLocation", (directory / wsa_file).resolve().as_uri())
    return etree.XMLSchema(document)


@dataclass
class Validator:
    """Compiled schemas for every version combination, from a directory holding the .xsd files."""

    schemas: dict[tuple[RMVersion, WsaVersion], etree.XMLSchema]
    wsmc: etree.XMLSchema | None = field(default=None)

    @classmethod
    def from_directory(cls, directory: Path) -> Validator:
        schemas = {key: load_schema(directory, *files) for key, files in SCHEMA_FILES.items()}
        return cls(schemas, etree.XMLSchema(etree.parse(str(directory / WSMC_SCHEMA_FILE), _parser())))

    def errors(self, data: bytes, rm: RMVersion, wsa: WsaVersion) -> list[str]:
        """Schema errors of every WS-RM / WS-Addressing element of the envelope (empty list: valid)."""
        schema = self.schemas[(rm, wsa)]
        root = etree.fromstring(data, _parser())
        soap_ns = next(ns for ns in SOAP_BY_NS if root.tag == f"{{{ns}}}Envelope")
        errors: list[str] = []
        elements = self._elements(root, soap_ns, RM_NS[rm], WSA_NS[wsa])
        for element in elements:
            if element.tag.startswith(f"{{{WSMC_NS}}}"):
                errors.extend(self._wsmc_errors(element, schema, rm, wsa))
            else:
                errors.extend(_errors(schema, element))
        if not elements:
            errors.append("no WS-RM or WS-Addressing element to validate")
        return errors

    def _wsmc_errors(self, element: Any, rm_schema: etree.XMLSchema, rm: RMVersion, wsa: WsaVersion) -> list[str]:
        if (rm, wsa) != _WSMC_VERSIONS or self.wsmc is None:
            return [f"{element.tag}: no WS-MakeConnection schema for WS-RM {rm.value} with WS-Addressing {wsa.value}"]
        errors = _errors(self.wsmc, element)
        for identifier in element.iterchildren(f"{{{RM_NS[rm]}}}Identifier"):
            errors.extend(_errors(rm_schema, identifier))
        return errors

    @staticmethod
    def _elements(root: Any, soap_ns: str, rm_ns: str, wsa_ns: str) -> list[Any]:
        found = []
        for part in root:
            if part.tag not in (f"{{{soap_ns}}}Header", f"{{{soap_ns}}}Body"):
                continue
            for element in part:
                if not isinstance(element.tag, str):
                    continue
                if element.tag.startswith((f"{{{rm_ns}}}", f"{{{wsa_ns}}}", f"{{{WSMC_NS}}}")):
                    found.append(element)
                elif element.tag == f"{{{soap_ns}}}Fault":
                    found.extend(e for e in element.iter(f"{{{rm_ns}}}Identifier"))
        return found


def _errors(schema: etree.XMLSchema, element: Any) -> list[str]:
    if schema.validate(copy.deepcopy(element)):
        return []
    return [f"{element.tag}: {e.message}" for e in schema.error_log]
