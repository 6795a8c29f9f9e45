/*
 * loadgen: AMQP 1.0 load generator for the amqpbroker benchmark harness.
 *
 * Built on the Qpid Proton-C proactor API.  One process runs S sender
 * connections and K receiver connections, all served by one proactor
 * (by default a single event-loop thread; --threads T adds threads).
 *
 * Senders send N messages in total (split evenly between senders), each
 * unsettled (snd-settle-mode unsettled), with at most --window deliveries
 * unsettled in flight per sender.  Receivers grant --credit and accept and
 * settle every message.  Every message body carries a magic marker, the
 * CLOCK_MONOTONIC send time and a sequence number, so the receiver (same
 * process, same clock) computes the end-to-end latency.
 *
 * At the end it prints one JSON line on stdout, e.g.
 *   {"sent":100000,"received":100000,"per_receiver":[100000],"unique":100000,
 *    "duplicates":0,"seconds":2.1,"msgs_per_s":47000.0,"p50_ms":..,"p99_ms":..,
 *    "loadgen_cpu_s":..,"loadgen_wall_s":..,"loadgen_cpu_pct":..,...,"timeout":false}
 * msgs_per_s counts distinct deliveries (for fan-out: deliveries, i.e. each
 * receiver's distinct messages) per second, from the first send to the last
 * needed delivery; a message delivered twice to a receiver (queue modes: to
 * any receiver) counts once and shows up in "duplicates".
 *
 * This is a benchmark tool, not a test: it measures, it does not assert.
 */
#define _GNU_SOURCE
#include <proton/condition.h>
#include <proton/connection.h>
#include <proton/delivery.h>
#include <proton/event.h>
#include <proton/link.h>
#include <proton/message.h>
#include <proton/proactor.h>
#include <proton/sasl.h>
#include <proton/session.h>
#include <proton/terminus.h>
#include <proton/transport.h>

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define MAGIC "LGBENCH1"
#define MAGIC_LEN 8
#define HDR_LEN (MAGIC_LEN + 8 + 8) /* magic, send time ns, sequence */

enum role { ROLE_SENDER = 1, ROLE_RECEIVER = 2 };

typedef struct conn_ctx {
  enum role role;
  int idx;
  pn_connection_t *conn;
  pn_link_t *link;
  bool closed; /* transport closed; guarded by g.lock */
  /* sender */
  uint64_t quota, sent, in_flight, accepted, rejected;
  double rate; /* msgs/s for this sender, 0 = unpaced */
  uint64_t seq_base;
  /* receiver */
  uint64_t received, unique;
  uint8_t *seen; /* per-receiver bitmap of sequence numbers (fan-out mode) */
  int64_t *lat_ns;
  size_t lat_len, lat_cap;
  int64_t *trace_sent; /* --latency-trace: send times, parallel to lat_ns */
  size_t trace_len, trace_cap;
  char *buf;
  size_t buf_len, buf_cap;
  bool attached;
} conn_ctx_t;

static struct {
  /* options */
  char host[256], port[32];
  const char *user, *password;
  const char *address;
  const char *recv_address; /* defaults to address */
  const char *shared_sub;   /* --shared-sub NAME: receivers share one subscription (JMS shared consumer) */
  uint64_t messages;
  size_t size;
  int senders, receivers;
  uint64_t window;
  int credit;
  bool durable;
  bool terminus_durable; /* terminus durability "configuration" (RabbitMQ: durable queue) */
  double rate;
  uint64_t burst; /* with --rate: messages each sender sends at once before pacing */
  double timeout_s;
  bool fanout;
  int threads;
  int start_delay_ms;
  bool verbose;

  pn_proactor_t *proactor;
  conn_ctx_t *conns;
  int nconns;
  pthread_mutex_t lock;

  /* encoded message template */
  char *tmpl;
  size_t tmpl_len;
  size_t body_off; /* offset of MAGIC inside tmpl */

  /* progress (atomic: touched from several connections) */
  atomic_int receivers_ready;
  atomic_int senders_ready;
  atomic_bool go;          /* senders may send */
  atomic_bool closing;     /* run finished, close everything */
  atomic_bool stop;        /* leave event loops */
  atomic_int closed_conns;
  atomic_uint_fast64_t total_received;
  atomic_uint_fast64_t total_unique;   /* first deliveries of a sequence number */
  atomic_uint_fast64_t bad_seq;        /* body without marker / out of range */
  atomic_uint_fast64_t foreign;        /* sent by an earlier run (a backlog) */
  bool drain_backlog;                  /* --drain-backlog: those count as deliveries */
  const char *trace_path;              /* --latency-trace FILE: one line per first delivery */
  _Atomic uint8_t *seen_all;           /* global bitmap (queue modes) */
  uint64_t seq_space;                  /* sequence numbers in use: [0, seq_space) */
  atomic_uint_fast64_t total_settled;  /* sender deliveries settled by peer */
  atomic_uint_fast64_t total_accepted;
  atomic_uint_fast64_t total_sent;
  atomic_bool timed_out;
  int64_t t_begin, t_go, t_end, t_ready_at, t_close;
  atomic_int_fast64_t t_first_send;
  atomic_int_fast64_t t_last_recv;
  char error[512];
  atomic_bool has_error;
} g;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void set_error(const char *fmt, ...) {
  pthread_mutex_lock(&g.lock);
  if (!atomic_load(&g.has_error)) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g.error, sizeof(g.error), fmt, ap);
    va_end(ap);
    atomic_store(&g.has_error, true);
  }
  pthread_mutex_unlock(&g.lock);
}

/* Wake every connection that is still alive (thread-safe). */
static void wake_all(int role_mask) {
  pthread_mutex_lock(&g.lock);
  for (int i = 0; i < g.nconns; ++i) {
    conn_ctx_t *c = &g.conns[i];
    if (!c->closed && (c->role & role_mask)) pn_connection_wake(c->conn);
  }
  pthread_mutex_unlock(&g.lock);
}

static void begin_close(void) {
  bool expected = false;
  if (atomic_compare_exchange_strong(&g.closing, &expected, true)) {
    g.t_end = now_ns();
    g.t_close = g.t_end;
    wake_all(ROLE_SENDER | ROLE_RECEIVER);
  }
}

static uint64_t expected_receives(void) {
  if (g.receivers == 0) return 0;
  uint64_t base = g.senders > 0 ? atomic_load(&g.total_accepted) : g.messages;
  return g.fanout ? base * (uint64_t)g.receivers : base;
}

static void check_done(void) {
  if (atomic_load(&g.closing)) return;
  if (g.senders > 0) {
    if (atomic_load(&g.total_settled) < g.messages) return;
  }
  /* count distinct deliveries, so that redeliveries cannot end the run early */
  if (atomic_load(&g.total_unique) < expected_receives()) return;
  begin_close();
}

static void start_senders(void) {
  bool expected = false;
  if (atomic_compare_exchange_strong(&g.go, &expected, true)) {
    g.t_go = now_ns();
    wake_all(ROLE_SENDER);
  }
}

static void maybe_ready(void) {
  /* Senders start only once every receiver link is attached, so that a
     topic subscriber sees every message. */
  if (atomic_load(&g.receivers_ready) < g.receivers) return;
  if (g.senders == 0) {
    if (!g.t_go) g.t_go = now_ns();
    return;
  }
  if (g.start_delay_ms <= 0) {
    start_senders();
  } else if (!g.t_ready_at) {
    g.t_ready_at = now_ns(); /* the timer tick starts the senders later */
  }
}

/* ---- sender ---------------------------------------------------------- */

static void sender_pump(conn_ctx_t *c) {
  if (!c->link || !atomic_load(&g.go) || atomic_load(&g.closing)) return;
  pn_link_t *l = c->link;
  if (pn_link_state(l) & PN_LOCAL_CLOSED) return;
  uint64_t limit = c->quota;
  if (c->rate > 0) {
    double el = (double)(now_ns() - g.t_go) / 1e9;
    uint64_t allowed = (uint64_t)(el * c->rate) + 1;
    if (allowed < g.burst) allowed = g.burst; /* a backlog at start goes at once */
    if (allowed < limit) limit = allowed;
  }
  while (c->sent < limit && c->in_flight < g.window && pn_link_credit(l) > 0) {
    uint64_t seq = c->seq_base + c->sent;
    int64_t t = now_ns();
    char *b = g.tmpl + g.body_off;
    memcpy(b + MAGIC_LEN, &t, 8);
    memcpy(b + MAGIC_LEN + 8, &seq, 8);
    pn_delivery_t *d = pn_delivery(l, pn_dtag((const char *)&seq, sizeof(seq)));
    (void)d;
    ssize_t n = pn_link_send(l, g.tmpl, g.tmpl_len);
    if (n < 0) {
      set_error("pn_link_send failed: %zd", n);
      begin_close();
      return;
    }
    pn_link_advance(l);
    if (c->sent == 0 && atomic_load(&g.t_first_send) == 0) {
      int_fast64_t z = 0;
      atomic_compare_exchange_strong(&g.t_first_send, &z, t);
    }
    c->sent++;
    c->in_flight++;
    atomic_fetch_add(&g.total_sent, 1);
  }
}

static void sender_outcome(conn_ctx_t *c, pn_delivery_t *d) {
  uint64_t state = pn_delivery_remote_state(d);
  bool rsettled = pn_delivery_settled(d);
  if (!state && !rsettled) return; /* nothing decided yet */
  if (state == PN_ACCEPTED || (state == 0 && rsettled)) {
    c->accepted++;
    atomic_fetch_add(&g.total_accepted, 1);
  } else {
    c->rejected++;
    if (c->rejected == 1 && g.verbose)
      fprintf(stderr, "loadgen: sender %d: delivery outcome %s\n", c->idx,
              pn_disposition_type_name(state));
  }
  pn_delivery_settle(d);
  c->in_flight--;
  atomic_fetch_add(&g.total_settled, 1);
  sender_pump(c);
  check_done();
}

/* ---- receiver -------------------------------------------------------- */

static void receiver_message(conn_ctx_t *c, const char *data, size_t len) {
  int64_t t_recv = now_ns();
  const char *p = NULL;
  if (len >= g.size && g.size >= HDR_LEN) {
    const char *tail = data + len - g.size; /* body is normally last */
    if (memcmp(tail, MAGIC, MAGIC_LEN) == 0) p = tail;
  }
  if (!p) p = memmem(data, len, MAGIC, MAGIC_LEN);
  bool fresh = false;
  if (p && (size_t)(data + len - p) >= HDR_LEN) {
    int64_t t_sent;
    uint64_t seq;
    memcpy(&t_sent, p + MAGIC_LEN, 8);
    memcpy(&seq, p + MAGIC_LEN + 8, 8);
    /* Send times are CLOCK_MONOTONIC, shared by every process on the machine:
       a message sent before this run began is a backlog left by an earlier
       run.  Its sequence number is not one of ours, so it must not end the
       run early by looking like one of our messages; with --drain-backlog
       (or with no senders: a drain) it counts as one delivery. */
    bool foreign = g.senders > 0 && t_sent < g.t_begin;
    if (foreign) {
      atomic_fetch_add(&g.foreign, 1);
      fresh = g.drain_backlog;
    } else if (seq < g.seq_space) {
      uint8_t bit = (uint8_t)(1u << (seq & 7));
      if (g.fanout) {
        fresh = !(c->seen[seq >> 3] & bit);
        c->seen[seq >> 3] |= bit;
      } else {
        fresh = !(atomic_fetch_or(&g.seen_all[seq >> 3], bit) & bit);
      }
    } else {
      atomic_fetch_add(&g.bad_seq, 1);
    }
    if (fresh && !foreign) { /* latency of first deliveries of this run only */
      if (c->lat_len == c->lat_cap) {
        c->lat_cap = c->lat_cap ? c->lat_cap * 2 : 4096;
        c->lat_ns = realloc(c->lat_ns, c->lat_cap * sizeof(int64_t));
      }
      if (g.trace_path) {
        if (c->trace_len == c->trace_cap) {
          c->trace_cap = c->trace_cap ? c->trace_cap * 2 : 4096;
          c->trace_sent = realloc(c->trace_sent, c->trace_cap * sizeof(int64_t));
        }
        c->trace_sent[c->trace_len++] = t_sent;
      }
      c->lat_ns[c->lat_len++] = t_recv - t_sent;
    }
  } else {
    atomic_fetch_add(&g.bad_seq, 1);
  }
  if (fresh) {
    c->unique++;
    atomic_fetch_add(&g.total_unique, 1);
  }
  c->received++;
  atomic_fetch_add(&g.total_received, 1);
  atomic_store(&g.t_last_recv, t_recv);
}

static void receiver_delivery(conn_ctx_t *c, pn_delivery_t *d) {
  if (!pn_delivery_readable(d)) return;
  pn_link_t *l = pn_delivery_link(d);
  size_t pending = pn_delivery_pending(d);
  if (c->buf_len + pending > c->buf_cap) {
    c->buf_cap = (c->buf_len + pending) * 2;
    c->buf = realloc(c->buf, c->buf_cap);
  }
  ssize_t n = pn_link_recv(l, c->buf + c->buf_len, pending);
  if (n == PN_ABORTED) {
    c->buf_len = 0;
    pn_delivery_settle(d);
    return;
  }
  if (n > 0) c->buf_len += (size_t)n;
  if (pn_delivery_partial(d)) return;
  receiver_message(c, c->buf, c->buf_len);
  c->buf_len = 0;
  pn_delivery_update(d, PN_ACCEPTED);
  pn_delivery_settle(d);
  int credit = pn_link_credit(l);
  if (credit <= g.credit / 2) pn_link_flow(l, g.credit - credit);
  check_done();
}

/* ---- events ---------------------------------------------------------- */

static void check_condition(pn_event_t *e, pn_condition_t *cond, const char *what) {
  if (pn_condition_is_set(cond)) {
    conn_ctx_t *c = (conn_ctx_t *)pn_connection_get_context(pn_event_connection(e));
    const char *name = pn_condition_get_name(cond);
    const char *desc = pn_condition_get_description(cond);
    if (!atomic_load(&g.closing) || g.verbose)
      fprintf(stderr, "loadgen: %s %d: %s: %s: %s\n",
              c ? (c->role == ROLE_SENDER ? "sender" : "receiver") : "?",
              c ? c->idx : -1, what, name ? name : "", desc ? desc : "");
    if (!atomic_load(&g.closing)) {
      set_error("%s: %s: %s", what, name ? name : "", desc ? desc : "");
      begin_close();
    }
  }
}

static void open_link(conn_ctx_t *c) {
  pn_connection_t *conn = c->conn;
  pn_session_t *s = pn_session(conn);
  pn_session_open(s);
  char name[64];
  if (c->role == ROLE_SENDER) {
    snprintf(name, sizeof name, "loadgen-sender-%d", c->idx);
    pn_link_t *l = pn_sender(s, name);
    pn_terminus_set_address(pn_link_target(l), g.address);
    if (g.terminus_durable) pn_terminus_set_durability(pn_link_target(l), PN_CONFIGURATION);
    pn_link_set_snd_settle_mode(l, PN_SND_UNSETTLED);
    pn_link_set_rcv_settle_mode(l, PN_RCV_FIRST);
    pn_link_open(l);
    c->link = l;
  } else {
    if (g.shared_sub) /* Qpid JMS's name for a shared non-durable consumer without a client-id */
      snprintf(name, sizeof name, "%s|global-volatile1", g.shared_sub);
    else
      snprintf(name, sizeof name, "loadgen-receiver-%d", c->idx);
    pn_link_t *l = pn_receiver(s, name);
    pn_terminus_set_address(pn_link_source(l), g.recv_address);
    if (g.shared_sub) {
      pn_data_t *caps = pn_terminus_capabilities(pn_link_source(l));
      pn_data_put_array(caps, false, PN_SYMBOL);
      pn_data_enter(caps);
      pn_data_put_symbol(caps, pn_bytes(5, "topic"));
      pn_data_put_symbol(caps, pn_bytes(6, "shared"));
      pn_data_put_symbol(caps, pn_bytes(6, "global"));
      pn_data_exit(caps);
      pn_terminus_set_expiry_policy(pn_link_source(l), PN_EXPIRE_WITH_LINK);
    }
    if (g.terminus_durable) pn_terminus_set_durability(pn_link_source(l), PN_CONFIGURATION);
    pn_link_set_snd_settle_mode(l, PN_SND_UNSETTLED);
    pn_link_set_rcv_settle_mode(l, PN_RCV_FIRST);
    pn_link_open(l);
    pn_link_flow(l, g.credit);
    c->link = l;
  }
}

static void handle(pn_event_t *e) {
  pn_connection_t *conn = pn_event_connection(e);
  conn_ctx_t *c = conn ? (conn_ctx_t *)pn_connection_get_context(conn) : NULL;

  switch (pn_event_type(e)) {
  case PN_CONNECTION_INIT:
    pn_connection_open(conn);
    open_link(c);
    break;

  case PN_LINK_REMOTE_OPEN: {
    pn_link_t *l = pn_event_link(e);
    bool ok = (c->role == ROLE_SENDER) ? pn_terminus_get_address(pn_link_remote_target(l)) != NULL
                                        : pn_terminus_get_address(pn_link_remote_source(l)) != NULL;
    if (!ok) break; /* refused attach: a detach with an error follows */
    if (c->role == ROLE_RECEIVER && !c->attached) {
      c->attached = true;
      atomic_fetch_add(&g.receivers_ready, 1);
      maybe_ready();
    } else if (c->role == ROLE_SENDER && !c->attached) {
      c->attached = true;
      atomic_fetch_add(&g.senders_ready, 1);
      sender_pump(c);
    }
    break;
  }

  case PN_LINK_FLOW:
    if (c->role == ROLE_SENDER) sender_pump(c);
    break;

  case PN_CONNECTION_WAKE:
    if (atomic_load(&g.closing)) {
      if (!(pn_connection_state(conn) & PN_LOCAL_CLOSED)) pn_connection_close(conn);
    } else if (c->role == ROLE_SENDER) {
      sender_pump(c);
    }
    break;

  case PN_DELIVERY: {
    pn_delivery_t *d = pn_event_delivery(e);
    if (c->role == ROLE_SENDER) {
      if (pn_delivery_updated(d)) sender_outcome(c, d);
    } else {
      receiver_delivery(c, d);
    }
    break;
  }

  case PN_TRANSPORT_CLOSED:
    check_condition(e, pn_transport_condition(pn_event_transport(e)), "transport");
    pthread_mutex_lock(&g.lock);
    if (c && !c->closed) {
      c->closed = true;
      atomic_fetch_add(&g.closed_conns, 1);
    }
    pthread_mutex_unlock(&g.lock);
    if (!atomic_load(&g.closing)) {
      set_error("connection closed before the run finished");
      begin_close();
    }
    break;

  case PN_CONNECTION_REMOTE_CLOSE:
    check_condition(e, pn_connection_remote_condition(conn), "connection");
    if (!(pn_connection_state(conn) & PN_LOCAL_CLOSED)) pn_connection_close(conn);
    break;

  case PN_SESSION_REMOTE_CLOSE:
    check_condition(e, pn_session_remote_condition(pn_event_session(e)), "session");
    if (!(pn_connection_state(conn) & PN_LOCAL_CLOSED)) pn_connection_close(conn);
    break;

  case PN_LINK_REMOTE_CLOSE:
  case PN_LINK_REMOTE_DETACH:
    check_condition(e, pn_link_remote_condition(pn_event_link(e)), "link");
    if (!(pn_connection_state(conn) & PN_LOCAL_CLOSED)) pn_connection_close(conn);
    break;

  case PN_PROACTOR_TIMEOUT: {
    int64_t t = now_ns();
    if (!atomic_load(&g.closing)) {
      if (!atomic_load(&g.go) && g.t_ready_at &&
          t - g.t_ready_at >= (int64_t)g.start_delay_ms * 1000000LL)
        start_senders();
      if ((double)(t - g.t_begin) / 1e9 > g.timeout_s) {
        atomic_store(&g.timed_out, true);
        begin_close();
      } else if (g.rate > 0 && atomic_load(&g.go)) {
        wake_all(ROLE_SENDER);
      }
    }
    if (atomic_load(&g.closing)) {
      /* all transports closed, or the peer is too slow to close: leave */
      if (atomic_load(&g.closed_conns) >= g.nconns || t - g.t_close > 3000000000LL) {
        atomic_store(&g.stop, true);
        pn_proactor_interrupt(g.proactor);
        break;
      }
    }
    pn_proactor_set_timeout(g.proactor, (g.rate > 0 && !atomic_load(&g.closing)) ? 1 : 20);
    break;
  }

  case PN_PROACTOR_INTERRUPT:
    atomic_store(&g.stop, true);
    pn_proactor_interrupt(g.proactor); /* pass it along to the other threads */
    break;

  default:
    break;
  }
}

static void *run_loop(void *arg) {
  (void)arg;
  while (!atomic_load(&g.stop)) {
    pn_event_batch_t *events = pn_proactor_wait(g.proactor);
    pn_event_t *e;
    while ((e = pn_event_batch_next(events))) handle(e);
    pn_proactor_done(g.proactor, events);
  }
  return NULL;
}

/* ---- setup / report -------------------------------------------------- */

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

static double pct_ms(int64_t *v, size_t n, double p) {
  if (n == 0) return -1;
  size_t i = (size_t)(p * (double)(n - 1) + 0.5);
  if (i >= n) i = n - 1;
  return (double)v[i] / 1e6;
}

static void build_template(void) {
  if (g.size < HDR_LEN) g.size = HDR_LEN;
  char *body = calloc(1, g.size);
  memcpy(body, MAGIC, MAGIC_LEN);
  for (size_t i = HDR_LEN; i < g.size; ++i) body[i] = (char)('a' + i % 26);
  pn_message_t *m = pn_message();
  pn_message_set_durable(m, g.durable);
  pn_message_set_inferred(m, true); /* binary body -> data section */
  pn_data_put_binary(pn_message_body(m), pn_bytes(g.size, body));
  size_t cap = g.size + 1024;
  g.tmpl = malloc(cap);
  g.tmpl_len = cap;
  if (pn_message_encode(m, g.tmpl, &g.tmpl_len) != 0) {
    fprintf(stderr, "loadgen: cannot encode message\n");
    exit(2);
  }
  char *p = memmem(g.tmpl, g.tmpl_len, MAGIC, MAGIC_LEN);
  if (!p) {
    fprintf(stderr, "loadgen: magic not found in encoded template\n");
    exit(2);
  }
  g.body_off = (size_t)(p - g.tmpl);
  pn_message_free(m);
  free(body);
}

static void parse_url(const char *url) {
  const char *u = url;
  if (strncmp(u, "amqp://", 7) == 0) u += 7;
  const char *at = strrchr(u, '@');
  if (at) {
    char creds[512];
    snprintf(creds, sizeof creds, "%.*s", (int)(at - u), u);
    char *colon = strchr(creds, ':');
    if (colon) {
      *colon = 0;
      if (!g.password) g.password = strdup(colon + 1);
    }
    if (!g.user) g.user = strdup(creds);
    u = at + 1;
  }
  const char *colon = strrchr(u, ':');
  if (colon) {
    snprintf(g.host, sizeof g.host, "%.*s", (int)(colon - u), u);
    snprintf(g.port, sizeof g.port, "%s", colon + 1);
  } else {
    snprintf(g.host, sizeof g.host, "%s", u);
    snprintf(g.port, sizeof g.port, "5672");
  }
  char *slash = strchr(g.port, '/');
  if (slash) *slash = 0;
}

static void usage(const char *prog) {
  fprintf(stderr,
          "usage: %s --url HOST:PORT --address ADDR [options]\n"
          "  --url [amqp://][USER:PASS@]HOST:PORT\n"
          "  --address ADDR          target address of the senders (and source of receivers)\n"
          "  --recv-address ADDR     source address of the receivers (default: --address)\n"
          "  --messages N            messages sent in total (default 100000)\n"
          "  --size B                body size in bytes (default 256, min %d)\n"
          "  --senders S             sender connections (default 1)\n"
          "  --receivers K           receiver connections (default 1)\n"
          "  --window W              max unsettled deliveries in flight per sender (default 1000)\n"
          "  --credit C              link credit each receiver grants (default 1000)\n"
          "  --durable               mark messages durable\n"
          "  --terminus-durable      terminus durability configuration on both links\n"
          "                          (RabbitMQ declares /queue/NAME durable)\n"
          "  --rate R                pace the senders to R msgs/s in total\n"
          "  --burst B               with --rate: each sender first sends B messages at once\n"
          "                          (a client starting with a backlog), then the pace catches up\n"
          "  --fanout                receivers each get every message (topic): expect N*K\n"
          "  --start-delay MS        wait MS after all receivers attached before sending\n"
          "  --user U --password P   SASL PLAIN credentials\n"
          "  --threads T             proactor threads (default 1)\n"
          "  --timeout S             give up after S seconds (default 120)\n"
          "  --drain-backlog         messages sent by an earlier run (\"foreign\") count as\n"
          "                          deliveries (receivers drain a backlog while senders add)\n"
          "  --latency-trace FILE    write \"send_ms latency_ms\" per first delivery\n"
          "  --shared-sub NAME       receivers share one subscription of the topic --recv-address\n"
          "                          (Qpid JMS shared consumer, no client-id: NAME|global-volatile1)\n"
          "  --verbose\n",
          prog, HDR_LEN);
}

/* --latency-trace FILE: "send_ms latency_ms" per first delivery, send time from the
   run's start, for finding when stalls happen. */
static void write_trace(void) {
  if (!g.trace_path) return;
  FILE *f = fopen(g.trace_path, "w");
  if (!f) return;
  for (int i = 0; i < g.nconns; ++i) {
    conn_ctx_t *c = &g.conns[i];
    for (size_t k = 0; k < c->trace_len && k < c->lat_len; ++k)
      fprintf(f, "%.3f %.3f\n", (double)(c->trace_sent[k] - g.t_begin) / 1e6, (double)c->lat_ns[k] / 1e6);
  }
  fclose(f);
}

static void print_json(void) {
  int64_t end = g.t_end ? g.t_end : now_ns();
  int64_t start = atomic_load(&g.t_first_send);
  if (!start) start = g.t_go ? g.t_go : g.t_begin;
  /* On a timeout, rate over the time messages were actually flowing. */
  int64_t last = atomic_load(&g.t_last_recv);
  if (atomic_load(&g.timed_out) && g.receivers > 0 && last > start) end = last;
  double secs = (double)(end - start) / 1e9;
  if (secs <= 0) secs = 1e-9;

  size_t nlat = 0;
  for (int i = 0; i < g.nconns; ++i) nlat += g.conns[i].lat_len;
  int64_t *all = malloc((nlat ? nlat : 1) * sizeof(int64_t));
  size_t k = 0;
  for (int i = 0; i < g.nconns; ++i) {
    memcpy(all + k, g.conns[i].lat_ns, g.conns[i].lat_len * sizeof(int64_t));
    k += g.conns[i].lat_len;
  }
  qsort(all, nlat, sizeof(int64_t), cmp_i64);

  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  double cpu = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 +
               (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
  /* wall time of the measurement (setup + run), not of the close handshake */
  double wall = (double)(end - g.t_begin) / 1e9;
  double close_s = g.t_close ? (double)(now_ns() - g.t_close) / 1e9 : 0.0;

  uint64_t sent = atomic_load(&g.total_sent);
  uint64_t received = atomic_load(&g.total_received);
  uint64_t accepted = atomic_load(&g.total_accepted);
  uint64_t settled = atomic_load(&g.total_settled);
  uint64_t unique = atomic_load(&g.total_unique);
  /* distinct deliveries per second; redeliveries are reported as duplicates */
  double rate = (g.receivers > 0 ? (double)unique : (double)accepted) / secs;

  printf("{\"sent\":%" PRIu64 ",\"accepted\":%" PRIu64 ",\"rejected\":%" PRIu64
         ",\"received\":%" PRIu64 ",\"per_receiver\":[",
         sent, accepted, settled - accepted, received);
  int first = 1;
  for (int i = 0; i < g.nconns; ++i) {
    if (g.conns[i].role != ROLE_RECEIVER) continue;
    printf("%s%" PRIu64, first ? "" : ",", g.conns[i].received);
    first = 0;
  }
  printf("],\"unique\":%" PRIu64 ",\"duplicates\":%" PRIu64 ",\"unparsed\":%" PRIu64,
         unique, received - unique,
         (uint64_t)atomic_load(&g.bad_seq));
  printf(",\"foreign\":%" PRIu64, (uint64_t)atomic_load(&g.foreign));
  printf(",\"seconds\":%.6f,\"msgs_per_s\":%.1f,\"sent_per_s\":%.1f", secs, rate,
         (double)sent / secs);
  if (nlat) {
    size_t over5 = 0;
    for (size_t i = 0; i < nlat; ++i) over5 += all[i] > 5000000;
    printf(",\"p50_ms\":%.3f,\"p90_ms\":%.3f,\"p99_ms\":%.3f,\"p999_ms\":%.3f,\"max_ms\":%.3f"
           ",\"over_5ms\":%zu",
           pct_ms(all, nlat, 0.50), pct_ms(all, nlat, 0.90), pct_ms(all, nlat, 0.99),
           pct_ms(all, nlat, 0.999), (double)all[nlat - 1] / 1e6, over5);
  } else {
    printf(",\"p50_ms\":null,\"p90_ms\":null,\"p99_ms\":null,\"p999_ms\":null,\"max_ms\":null"
           ",\"over_5ms\":null");
  }
  write_trace();
  printf(",\"latency_samples\":%zu,\"loadgen_cpu_s\":%.3f,\"loadgen_wall_s\":%.3f,"
         "\"loadgen_cpu_pct\":%.1f",
         nlat, cpu, wall, wall > 0 ? 100.0 * cpu / wall : 0.0);
  printf(",\"messages\":%" PRIu64 ",\"size\":%zu,\"senders\":%d,\"receivers\":%d,"
         "\"window\":%" PRIu64 ",\"credit\":%d,\"rate\":%.1f,\"fanout\":%s,\"durable\":%s",
         g.messages, g.size, g.senders, g.receivers, g.window, g.credit, g.rate,
         g.fanout ? "true" : "false", g.durable ? "true" : "false");
  printf(",\"burst\":%" PRIu64, g.burst);
  printf(",\"close_s\":%.3f,\"unclosed\":%d", close_s, g.nconns - atomic_load(&g.closed_conns));
  printf(",\"timeout\":%s", atomic_load(&g.timed_out) ? "true" : "false");
  if (atomic_load(&g.has_error)) {
    printf(",\"error\":\"");
    for (const char *p = g.error; *p; ++p) {
      if (*p == '"' || *p == '\\') putchar('\\');
      if ((unsigned char)*p < 0x20) putchar(' '); else putchar(*p);
    }
    printf("\"");
  }
  printf("}\n");
  fflush(stdout);
  free(all);
}

int main(int argc, char **argv) {
  const char *url = NULL;
  g.messages = 100000;
  g.size = 256;
  g.senders = 1;
  g.receivers = 1;
  g.window = 1000;
  g.credit = 1000;
  g.timeout_s = 120;
  g.threads = 1;

  static struct option opts[] = {
      {"url", required_argument, 0, 'u'},       {"address", required_argument, 0, 'a'},
      {"recv-address", required_argument, 0, 'A'},
      {"messages", required_argument, 0, 'n'},  {"size", required_argument, 0, 's'},
      {"senders", required_argument, 0, 'S'},   {"receivers", required_argument, 0, 'R'},
      {"window", required_argument, 0, 'w'},    {"credit", required_argument, 0, 'c'},
      {"durable", no_argument, 0, 'd'},         {"rate", required_argument, 0, 'r'},
      {"terminus-durable", no_argument, 0, 'Q'},
      {"timeout", required_argument, 0, 't'},   {"fanout", no_argument, 0, 'f'},
      {"user", required_argument, 0, 'U'},      {"password", required_argument, 0, 'P'},
      {"threads", required_argument, 0, 'T'},   {"start-delay", required_argument, 0, 'D'},
      {"verbose", no_argument, 0, 'v'},         {"help", no_argument, 0, 'h'},
      {"drain-backlog", no_argument, 0, 'B'},
      {"latency-trace", required_argument, 0, 'L'},
      {"shared-sub", required_argument, 0, 'H'},
      {"burst", required_argument, 0, 'b'},
      {0, 0, 0, 0}};
  int o;
  while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (o) {
    case 'u': url = optarg; break;
    case 'a': g.address = optarg; break;
    case 'A': g.recv_address = optarg; break;
    case 'n': g.messages = strtoull(optarg, NULL, 10); break;
    case 's': g.size = strtoul(optarg, NULL, 10); break;
    case 'S': g.senders = atoi(optarg); break;
    case 'R': g.receivers = atoi(optarg); break;
    case 'w': g.window = strtoull(optarg, NULL, 10); break;
    case 'c': g.credit = atoi(optarg); break;
    case 'd': g.durable = true; break;
    case 'Q': g.terminus_durable = true; break;
    case 'r': g.rate = atof(optarg); break;
    case 't': g.timeout_s = atof(optarg); break;
    case 'f': g.fanout = true; break;
    case 'U': g.user = optarg; break;
    case 'P': g.password = optarg; break;
    case 'T': g.threads = atoi(optarg); break;
    case 'D': g.start_delay_ms = atoi(optarg); break;
    case 'v': g.verbose = true; break;
    case 'B': g.drain_backlog = true; break;
    case 'L': g.trace_path = optarg; break;
    case 'H': g.shared_sub = optarg; break;
    case 'b': g.burst = strtoull(optarg, NULL, 10); break;
    case 'h': usage(argv[0]); return 0;
    default: usage(argv[0]); return 2;
    }
  }
  if (!url || !g.address || g.senders < 0 || g.receivers < 0 || g.senders + g.receivers == 0 ||
      g.window < 1 || g.credit < 1 || g.threads < 1) {
    usage(argv[0]);
    return 2;
  }
  if (!g.recv_address) g.recv_address = g.address;
  parse_url(url);
  build_template();
  pthread_mutex_init(&g.lock, NULL);

  g.t_begin = now_ns();
  g.proactor = pn_proactor();
  g.nconns = g.senders + g.receivers;
  g.conns = calloc((size_t)g.nconns, sizeof(conn_ctx_t));
  char addr[PN_MAX_ADDR];
  pn_proactor_addr(addr, sizeof addr, g.host, g.port);

  g.seq_space = g.messages;
  size_t bm = (size_t)(g.seq_space / 8 + 1);
  if (!g.fanout) g.seen_all = calloc(bm, 1);
  uint64_t per = g.senders ? g.messages / (uint64_t)g.senders : 0;
  uint64_t rem = g.senders ? g.messages % (uint64_t)g.senders : 0;
  uint64_t seq = 0;
  for (int i = 0; i < g.nconns; ++i) {
    conn_ctx_t *c = &g.conns[i];
    /* receivers first, so they are attaching before the senders connect */
    if (i < g.receivers) {
      c->role = ROLE_RECEIVER;
      c->idx = i;
      if (g.fanout) c->seen = calloc(bm, 1);
    } else {
      c->role = ROLE_SENDER;
      c->idx = i - g.receivers;
      c->quota = per + ((uint64_t)c->idx < rem ? 1 : 0);
      c->seq_base = seq;
      seq += c->quota;
      c->rate = g.rate > 0 ? g.rate / g.senders : 0;
    }
    c->conn = pn_connection();
    pn_connection_set_context(c->conn, c);
    char cid[64];
    snprintf(cid, sizeof cid, "loadgen-%d-%s-%d", (int)getpid(),
             c->role == ROLE_SENDER ? "s" : "r", c->idx);
    pn_connection_set_container(c->conn, cid);
    pn_transport_t *t = pn_transport();
    if (g.user) {
      pn_connection_set_user(c->conn, g.user);
      if (g.password) pn_connection_set_password(c->conn, g.password);
      pn_sasl_t *sasl = pn_sasl(t);
      pn_sasl_set_allow_insecure_mechs(sasl, true);
      pn_sasl_allowed_mechs(sasl, "PLAIN");
    }
    pn_proactor_connect2(g.proactor, c->conn, t, addr);
  }
  pn_proactor_set_timeout(g.proactor, 20);
  if (g.receivers == 0) maybe_ready(); /* no receiver to wait for: senders go at once */

  pthread_t *th = calloc((size_t)g.threads, sizeof(pthread_t));
  for (int i = 1; i < g.threads; ++i) pthread_create(&th[i], NULL, run_loop, NULL);
  run_loop(NULL);
  for (int i = 1; i < g.threads; ++i) pthread_join(th[i], NULL);

  if (!g.t_end) g.t_end = now_ns();
  print_json();
  /* Connections may still be open if the peer never answered the close;
     do not wait for them: exit without freeing the proactor. */
  bool ok = !atomic_load(&g.has_error) && !atomic_load(&g.timed_out);
  fflush(stdout);
  _exit(ok ? 0 : 1);
}
