"""Validation of emitted envelopes against the official WS-RM and WS-Addressing schemas, offline.

The schemas' ``xs:import`` elements point at network locations; ``load_schemas`` rewrites each one to the
local copy of the imported file before compiling, and parses with ``no_network=True``, so nothing is ever
fetched. There is no SOAP envelope schema here: each WS-RM and WS-Addressing element under Header and Body
(and the wsrm:Identifier inside a fault's Detail) is validated on its own, as the WS-RM specs suggest.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lxml import etree

from qtp.wsrm.codec._names import RM_NS, SOAP_BY_NS, WSA_NS, WsaVersion
from qtp.wsrm.protocol import RMVersion

# (WS-RM version, WS-Addressing version) -> (WS-RM schema file, the addressing schema it imports)
SCHEMA_FILES = {
    (RMVersion.WSRM10, WsaVersion.WSA200408): ("metro-wsrm-200502.xsd", "ws-addr-2004-08.xsd"),
    (RMVersion.WSRM10, WsaVersion.WSA200508): ("cxf-wsrm-1.0-wsa15.xsd", "ws-addr-2005-08.xsd"),
    (RMVersion.WSRM11, WsaVersion.WSA200508): ("metro-wsrm-200702.xsd", "ws-addr-2005-08.xsd"),
}
_XS = "http://www.w3.org/2001/XMLSchema"


def load_schema(directory: Path, rm_file: str, wsa_file: str) -> etree.XMLSchema:
    parser = etree.XMLParser(no_network=True, resolve_entities=False)
    document = etree.parse(str(directory / rm_file), parser)
    for imported in document.getroot().iter(f"{{{_XS}}}import"):
        imported.set("schemaLocation", (directory / wsa_file).resolve().as_uri())
    return etree.XMLSchema(document)


@dataclass
class Validator:
    """Compiled schemas for every version combination, from a directory holding the .xsd files."""

    schemas: dict[tuple[RMVersion, WsaVersion], etree.XMLSchema]

    @classmethod
    def from_directory(cls, directory: Path) -> Validator:
        return cls({key: load_schema(directory, *files) for key, files in SCHEMA_FILES.items()})

    def errors(self, data: bytes, rm: RMVersion, wsa: WsaVersion) -> list[str]:
        """Schema errors of every WS-RM / WS-Addressing element of the envelope (empty list: valid)."""
        schema = self.schemas[(rm, wsa)]
        root = etree.fromstring(data, etree.XMLParser(no_network=True, resolve_entities=False))
        soap_ns = next(ns for ns in SOAP_BY_NS if root.tag == f"{{{ns}}}Envelope")
        errors: list[str] = []
        checked = 0
        for element in self._elements(root, soap_ns, RM_NS[rm], WSA_NS[wsa]):
            checked += 1
            if not schema.validate(copy.deepcopy(element)):
                errors.extend(f"{element.tag}: {e.message}" for e in schema.error_log)
        if checked == 0:
            errors.append("no WS-RM or WS-Addressing element to validate")
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
                if element.tag.startswith((f"{{{rm_ns}}}", f"{{{wsa_ns}}}")):
                    found.append(element)
                elif element.tag == f"{{{soap_ns}}}Fault":
                    found.extend(e for e in element.iter(f"{{{rm_ns}}}Identifier"))
        return found
