/*
 * qtp interop test client: a WS-RM source built on gSOAP's wsrm plugin.
 *
 * Creates one sequence at --url, sends --count one-way <ns:deliver> messages on it (each with AckRequested),
 * completes the sequence (WS-RM 1.1: CloseSequence; WS-RM 1.0: the empty LastMessage), resends whatever is
 * still unacknowledged for up to --rounds rounds, and terminates. Every step is printed to stdout as one
 * line "EVENT key=value ..." so a test can read it. Exit status: 0 when every message was acknowledged and the
 * sequence terminated; 3 when every message was acknowledged but TerminateSequence failed; 1 otherwise;
 * 2 for bad arguments. (soap_wsrm_nack() counts only messages the destination named in a Nack, so the
 * client counts the messages still held for retransmission itself: the plugin drops a message once an
 * acknowledgement names it.)
 *
 * Built twice by build.sh: once against wsrm.h (WS-RM 1.1) and once against wsrm5.h (WS-RM 1.0); the
 * WS-RM version is fixed at build time, the SOAP version is chosen with --soap.
 */

#include "wsrmapi.h"
#include "rmtest.nsmap"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DELIVER_ACTION "urn:qtp:interop:gsoap/deliver"

#ifdef SOAP_WSRM_2005
#define RM_VERSION "1.0"
#else
#define RM_VERSION "1.1"
#endif

struct options {
  const char *url;
  long count;
  int soap_version;      /* 1 or 2 */
  long expires_ms;
  const char *prefix;
  int rounds;            /* resend rounds after completion */
  int tries;             /* transport attempts per message */
  int timeout;           /* seconds for connect, send, receive */
  int pause_ms;          /* between transport attempts and resend rounds */
};

static void usage(void)
{
  fprintf(stderr,
    "usage: client --url URL [--count N] [--soap 1.1|1.2] [--expires-ms MS] [--prefix TEXT]\n"
    "              [--rounds R] [--tries T] [--timeout S] [--pause-ms MS]\n");
}

static int parse(int argc, char **argv, struct options *o)
{
  int i;
  o->url = NULL;
  o->count = 3;
  o->soap_version = 1;
  o->expires_ms = 600000;
  o->prefix = "message";
  o->rounds = 5;
  o->tries = 20;
  o->timeout = 5;
  o->pause_ms = 200;
  for (i = 1; i < argc; i++)
  {
    const char *name = argv[i];
    const char *value = i + 1 < argc ? argv[i + 1] : NULL;
    if (!value)
      return -1;
    i++;
    if (!strcmp(name, "--url"))
      o->url = value;
    else if (!strcmp(name, "--count"))
      o->count = atol(value);
    else if (!strcmp(name, "--soap"))
    {
      if (!strcmp(value, "1.1"))
        o->soap_version = 1;
      else if (!strcmp(value, "1.2"))
        o->soap_version = 2;
      else
        return -1;
    }
    else if (!strcmp(name, "--expires-ms"))
      o->expires_ms = atol(value);
    else if (!strcmp(name, "--prefix"))
      o->prefix = value;
    else if (!strcmp(name, "--rounds"))
      o->rounds = atoi(value);
    else if (!strcmp(name, "--tries"))
      o->tries = atoi(value);
    else if (!strcmp(name, "--timeout"))
      o->timeout = atoi(value);
    else if (!strcmp(name, "--pause-ms"))
      o->pause_ms = atoi(value);
    else
      return -1;
  }
  return o->url && o->count >= 0 && o->tries > 0 ? 0 : -1;
}

/* One line describing the soap context's error, on stdout with the events. */
static void report_error(struct soap *soap, const char *step)
{
  const char *code = *soap_faultcode(soap);
  const char *sub = soap_fault_subcode(soap);
  const char *text = *soap_faultstring(soap);
  printf("ERROR step=%s error=%d code=%s subcode=%s reason=\"%s\"\n", step, soap->error,
         code ? code : "-", sub ? sub : "-", text ? text : "");
  fflush(stdout);
}

static void pause_ms(int ms)
{
  if (ms > 0)
    usleep((useconds_t)ms * 1000);
}

/* The answer to a one-way message: nothing (HTTP 202), or an envelope whose header may carry
   SequenceAcknowledgement (read so that the plugin records the acknowledgement). */
static int receive_answer(struct soap *soap)
{
  struct __wsrm__SequenceAcknowledgement ignored;
  if (soap_recv___wsrm__SequenceAcknowledgement(soap, &ignored) == SOAP_OK)
    return SOAP_OK;
  if (soap->error == 202 || soap->error == SOAP_NO_DATA || soap->error == SOAP_NO_TAG)
    return soap->error = SOAP_OK;
  return soap->error;
}

/* Messages sent and not yet acknowledged (the plugin frees a message when an acknowledgement names it). */
static ULONG64 unacknowledged(soap_wsrm_sequence_handle seq)
{
  ULONG64 count = 0;
  struct soap_wsrm_message *p;
  for (p = seq->messages; p; p = p->next)
    if (p->state != SOAP_WSRM_ACK)
      count++;
  return count;
}

static int send_one(struct soap *soap, soap_wsrm_sequence_handle seq, const struct options *o, long number)
{
  char text[256];
  int attempt;
  struct SOAP_ENV__Header header;
  snprintf(text, sizeof(text), "%s-%ld", o->prefix, number);
  if (soap_wsrm_request_acks(soap, seq, NULL, DELIVER_ACTION))
  {
    report_error(soap, "request");
    return soap->error;
  }
  header = *soap->header;   /* reading an answer replaces soap->header; a retry sends these headers again */
  for (attempt = 1; attempt <= o->tries; attempt++)
  {
    if (attempt > 1)
    {
      soap_header(soap);
      *soap->header = header;
    }
    if (soap_send_ns__deliver(soap, soap_wsrm_to(seq), DELIVER_ACTION, text) == SOAP_OK
     && receive_answer(soap) == SOAP_OK)
    {
      printf("SENT number=" SOAP_ULONG_FORMAT " text=%s attempts=%d\n", soap_wsrm_num(seq), text, attempt);
      fflush(stdout);
      return SOAP_OK;
    }
    report_error(soap, "send");
    soap_closesock(soap);
    if (soap->error == SOAP_FAULT)
      return soap->error;   /* the destination refused the message: no retry */
    soap_header(soap);
    *soap->header = header;
    if (soap_wsrm_check_retry(soap, seq))
      return soap->error;
    pause_ms(o->pause_ms);
  }
  return soap->error ? soap->error : SOAP_EOF;
}

int main(int argc, char **argv)
{
  struct options o;
  struct soap *soap;
  soap_wsrm_sequence_handle seq = NULL;
  long i;
  int attempt, round, status = 1, terminated = 0;
  if (parse(argc, argv, &o))
  {
    usage();
    return 2;
  }
  soap = soap_new();
  if (o.soap_version == 2)
  {
    /* gSOAP takes the SOAP version to send from the first two entries of the namespace table */
    static struct Namespace soap12[sizeof(namespaces) / sizeof(namespaces[0])];
    memcpy(soap12, namespaces, sizeof(namespaces));
    soap12[0].ns = "http://www.w3.org/2003/05/soap-envelope";
    soap12[1].ns = "http://www.w3.org/2003/05/soap-encoding";
    soap_set_namespaces(soap, soap12);
  }
  else
    soap_set_namespaces(soap, namespaces);
  soap->connect_timeout = soap->send_timeout = soap->recv_timeout = o.timeout;
  soap_register_plugin(soap, soap_wsa);
  soap_register_plugin(soap, soap_wsrm);
  printf("START rm=%s soap=%s url=%s count=%ld\n", RM_VERSION, o.soap_version == 2 ? "1.2" : "1.1", o.url, o.count);
  fflush(stdout);

  for (attempt = 1; attempt <= o.tries; attempt++)
  {
    if (soap_wsrm_create(soap, o.url, NULL, o.expires_ms, NULL, &seq) == SOAP_OK)
      break;
    report_error(soap, "create");
    if (seq)
      soap_wsrm_seq_free(soap, seq);
    seq = NULL;
    soap_closesock(soap);
    pause_ms(o.pause_ms);
  }
  if (!seq)
    goto done;
  printf("CREATED id=%s attempts=%d\n", seq->id, attempt);
  fflush(stdout);

  for (i = 1; i <= o.count; i++)
    if (send_one(soap, seq, &o, i))
      goto done;

  /* Complete the sequence, then resend what is still unacknowledged. WS-RM 1.1 asks again with a new
     CloseSequence (its response carries the acknowledgement); WS-RM 1.0 has nothing but the messages'
     own AckRequested, so it resends and relies on the acknowledgements that come back. */
  for (round = 0; ; round++)
  {
#ifdef SOAP_WSRM_2005
    if (round == 0 && soap_wsrm_close(soap, seq, NULL))
#else
    if (soap_wsrm_close(soap, seq, NULL))
#endif
      report_error(soap, "close");
    else
    {
      printf("CLOSED round=%d unacknowledged=" SOAP_ULONG_FORMAT "\n", round, unacknowledged(seq));
      fflush(stdout);
    }
    soap_closesock(soap);
    if (!unacknowledged(seq) || round >= o.rounds)
      break;
    pause_ms(o.pause_ms);
    if (soap_wsrm_resend(soap, seq, 0, 0))
      report_error(soap, "resend");
    soap_closesock(soap);
    printf("RESENT round=%d\n", round + 1);
    fflush(stdout);
  }

  for (attempt = 1; attempt <= o.tries; attempt++)
  {
    if (soap_wsrm_terminate(soap, seq, NULL) == SOAP_OK)
      break;
    report_error(soap, "terminate");
    soap_closesock(soap);
    if (soap->error == SOAP_FAULT)
      break;
    pause_ms(o.pause_ms);
  }
  terminated = attempt <= o.tries && soap->error == SOAP_OK;
  printf("%s id=%s sent=" SOAP_ULONG_FORMAT " unacknowledged=" SOAP_ULONG_FORMAT "\n",
         terminated ? "TERMINATED" : "UNTERMINATED", seq->id, soap_wsrm_num(seq), unacknowledged(seq));
  status = unacknowledged(seq) ? 1 : terminated ? 0 : 3;

done:
  printf("EXIT status=%d\n", status);
  fflush(stdout);
  if (seq)
    soap_wsrm_seq_free(soap, seq);
  soap_destroy(soap);
  soap_end(soap);
  soap_free(soap);
  return status;
}
