#!/usr/bin/env bash
# Builds the gSOAP interop client and server for WS-RM 1.1 and WS-RM 1.0 from the Debian packages gsoap and
# libgsoap-dev (scripts/system-deps.sh installs them). Usage: build.sh [BUILD_DIR]; default ./build next to
# this script (ignored by git). Produces BUILD_DIR/{client,server}-rm11 and BUILD_DIR/{client,server}-rm10.
#
# gSOAP's plugin sources are compiled as installed, with one exception: Debian's 2.8.124 wsrmapi.h declares
# __wsrm__TerminateSequence for WS-RM 1.0 (SOAP_WSRM_2005) with a TerminateSequenceType response, while
# wsrm5.h/wsrx5.h (and wsrmapi.c's definition) use TerminateSequenceResponseType. The WS-RM 1.0 build uses a
# copy of wsrmapi.h with that one declaration corrected; nothing else is changed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/build}"
gsoap=/usr/share/gsoap
for need in soapcpp2 cc pkg-config; do
  command -v "$need" >/dev/null || { echo "build.sh: $need is missing (make deps installs it)" >&2; exit 1; }
done
[ -f "$gsoap/plugin/wsrmapi.c" ] || { echo "build.sh: $gsoap/plugin is missing (libgsoap-dev)" >&2; exit 1; }
cflags="$(pkg-config --cflags gsoap) -O1 -w"
libs="$(pkg-config --libs gsoap) -lpthread"
mkdir -p "$out"
for v in 11 10; do
  gen="$out/gen-rm$v"
  rm -rf "$gen" && mkdir -p "$gen"
  soapcpp2 -c -a -x -L -d "$gen" -I"$here:$gsoap/import:$gsoap" "$here/rmtest$v.h" >"$gen/soapcpp2.log" 2>&1 \
    || { cat "$gen/soapcpp2.log" >&2; exit 1; }
  # wsrmapi.c includes "wsrmapi.h" from its own directory first, so both are copied next to the generated code.
  cp "$gsoap/plugin/wsrmapi.c" "$gsoap/plugin/wsrmapi.h" "$gen/"
  if [ "$v" = 10 ]; then
    bad='__wsrm__TerminateSequence(struct soap \*soap, struct wsrm__TerminateSequenceType \*req, struct wsrm__TerminateSequenceType \*res);'
    good='__wsrm__TerminateSequence(struct soap *soap, struct wsrm__TerminateSequenceType *req, struct wsrm__TerminateSequenceResponseType *res);'
    grep -q "$bad" "$gen/wsrmapi.h" || { echo "build.sh: wsrmapi.h no longer has the declaration to correct" >&2; exit 1; }
    sed -i "s/$bad/$good/" "$gen/wsrmapi.h"
  fi
  common=("$gen/soapC.c" "$gen/wsrmapi.c" "$gsoap/plugin/wsaapi.c" "$gsoap/custom/duration.c")
  inc=(-I"$gen" -I"$gsoap/plugin" -I"$gsoap")
  # shellcheck disable=SC2086
  cc $cflags "${inc[@]}" -o "$out/client-rm$v" "$here/client.c" "$gen/soapClient.c" "${common[@]}" $libs
  # shellcheck disable=SC2086
  cc $cflags "${inc[@]}" -o "$out/server-rm$v" "$here/server.c" "$gen/soapClient.c" "$gen/soapServer.c" "${common[@]}" $libs
done
echo "built: $out/client-rm11 $out/server-rm11 $out/client-rm10 $out/server-rm10"
