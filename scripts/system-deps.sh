#!/usr/bin/env bash
# Installs the Debian packages qtp's tests and demo need (databases, JDBC drivers, gSOAP and a C compiler), only where they are missing.
set -euo pipefail
need=()
command -v mariadbd >/dev/null 2>&1 || [ -x /usr/sbin/mariadbd ] || need+=(mariadb-server)
command -v mariadb-install-db >/dev/null 2>&1 || need+=(mariadb-server)
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)
ls /usr/share/java/postgresql*.jar >/dev/null 2>&1 || need+=(libpostgresql-jdbc-java)
ls /usr/share/java/mariadb-java-client*.jar >/dev/null 2>&1 || need+=(libmariadb-java)
# gSOAP and its wsrm plugin, for the interop tests (tests/interop/gsoap builds a client and a server with them)
command -v soapcpp2 >/dev/null 2>&1 || need+=(gsoap)
[ -f /usr/share/gsoap/plugin/wsrmapi.c ] && [ -f /usr/include/stdsoap2.h ] || need+=(libgsoap-dev)
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
command -v make >/dev/null 2>&1 || need+=(make)
# HAProxy: the load balancer in front of a node's replicas in tests/test_shared.py and benchmarks/e2e_throughput.py
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || need+=(haproxy)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "qtp needs these Debian packages: ${need[*]}; run: sudo apt-get install ${need[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${need[@]}"
fi
