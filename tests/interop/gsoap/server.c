/*
 * qtp interop test server: a WS-RM destination built on gSOAP's wsrm plugin.
 *
 * Listens on --port, accepts sequences (CreateSequence, Close, Terminate are the plugin's own operations)
 * and the one-way <ns:deliver> message. Every message the plugin lets through to the application is
 * reported as one line on stdout (or in --log):
 *
 *     DELIVERED id=<sequence identifier> number=<message number> text=<body text>
 *
 * so a test can check that each message arrived exactly once and in order. "READY port=<port>" is printed
 * once the socket is bound. Between requests (every --pulse-ms) the plugin sends acknowledgements to
 * addressable AcksTo endpoints (soap_wsrm_pulse). --wait-ms makes the destination hold a message that
 * arrives after a gap for up to that long, waiting for the missing ones (soap_wsrm_check_and_wait); the
 * default 0 drops it, relying on the source to send it again. --mode: "check" (default) runs soap_wsrm_check
 * and then answers 202, so a fault (UnknownSequence, ...) reaches the source; "empty" uses
 * soap_wsrm_check_send_empty_response, the plugin's documented one-way call, which answers 202 before it
 * checks anything, so faults are never seen by the source. SIGTERM ends the process.
 */

#include "wsrmapi.h"
#include "rmtest.nsmap"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef SOAP_WSRM_2005
#define RM_VERSION "1.0"
#else
#define RM_VERSION "1.1"
#endif

static FILE *out;
static int wait_ms = 0;
static int empty_first = 0;
static volatile sig_atomic_t stopping = 0;

static void on_signal(int sig)
{
  (void)sig;
  stopping = 1;
}

int ns__deliver(struct soap *soap, char *text)
{
  int status;
  if (empty_first)
    status = wait_ms > 0 ? soap_wsrm_check_send_empty_response_and_wait(soap, -1000 * wait_ms)
                         : soap_wsrm_check_send_empty_response(soap);
  else
  {
    status = wait_ms > 0 ? soap_wsrm_check_and_wait(soap, -1000 * wait_ms) : soap_wsrm_check(soap);
    if (status == SOAP_OK)
      soap_send_empty_response(soap, 202);
  }
  if (status)
    return soap->error;   /* SOAP_STOP: a duplicate or an out-of-order message, not delivered; else a fault */
  fprintf(out, "DELIVERED id=%s number=" SOAP_ULONG_FORMAT " text=%s\n",
          soap->header->wsrm__Sequence->Identifier, soap->header->wsrm__Sequence->MessageNumber,
          text ? text : "");
  fflush(out);
  return SOAP_OK;
}

/* A SOAP fault sent to this endpoint as a message of its own (for example to a FaultTo address): record it,
   answer 202. */
int SOAP_ENV__Fault(struct soap *soap, char *faultcode, char *faultstring, char *faultactor,
                    struct SOAP_ENV__Detail *detail, struct SOAP_ENV__Code *code, struct SOAP_ENV__Reason *reason,
                    char *node, char *role, struct SOAP_ENV__Detail *detail12)
{
  (void)faultactor; (void)detail; (void)node; (void)role; (void)detail12;
  fprintf(out, "FAULT code=%s reason=\"%s\"\n",
          faultcode ? faultcode : (code && code->SOAP_ENV__Value ? code->SOAP_ENV__Value : "-"),
          faultstring ? faultstring : (reason && reason->SOAP_ENV__Text ? reason->SOAP_ENV__Text : ""));
  fflush(out);
  return soap_send_empty_response(soap, 202);
}

int main(int argc, char **argv)
{
  struct soap *soap;
  int port = 0, pulse_ms = 200, i;
  const char *log = NULL;
  for (i = 1; i + 1 < argc; i += 2)
  {
    if (!strcmp(argv[i], "--port"))
      port = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--log"))
      log = argv[i + 1];
    else if (!strcmp(argv[i], "--wait-ms"))
      wait_ms = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--mode") && (!strcmp(argv[i + 1], "check") || !strcmp(argv[i + 1], "empty")))
      empty_first = !strcmp(argv[i + 1], "empty");
    else if (!strcmp(argv[i], "--pulse-ms"))
      pulse_ms = atoi(argv[i + 1]);
    else
      break;
  }
  if (i != argc || port <= 0)
  {
    fprintf(stderr, "usage: server --port PORT [--log FILE] [--wait-ms MS] [--pulse-ms MS] [--mode check|empty]\n");
    return 2;
  }
  out = log ? fopen(log, "a") : stdout;
  if (!out)
  {
    perror(log);
    return 2;
  }
  signal(SIGTERM, on_signal);
  signal(SIGINT, on_signal);
  signal(SIGPIPE, SIG_IGN);
  soap = soap_new();
  soap_set_namespaces(soap, namespaces);
  soap_register_plugin(soap, soap_wsa);
  soap_register_plugin(soap, soap_wsrm);
  soap->bind_flags = SO_REUSEADDR;
  soap->send_timeout = soap->recv_timeout = 5;
  soap->accept_timeout = -1000 * pulse_ms;
  if (!soap_valid_socket(soap_bind(soap, "127.0.0.1", port, 16)))
  {
    soap_print_fault(soap, stderr);
    return 1;
  }
  printf("READY port=%d rm=%s mode=%s\n", port, RM_VERSION, empty_first ? "empty" : "check");
  fflush(stdout);
  while (!stopping)
  {
    if (!soap_valid_socket(soap_accept(soap)))
    {
      if (soap->errnum && !stopping)
      {
        soap_print_fault(soap, stderr);
        break;
      }
      soap_wsrm_pulse(soap, -100000);   /* acknowledgements to addressable AcksTo endpoints */
      continue;
    }
    if (soap_serve(soap) && soap->error != SOAP_STOP)
      soap_print_fault(soap, stderr);
    soap_destroy(soap);
    soap_end(soap);
  }
  soap_destroy(soap);
  soap_end(soap);
  soap_free(soap);
  if (out != stdout)
    fclose(out);
  return 0;
}
