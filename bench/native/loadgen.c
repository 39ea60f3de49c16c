/*
 * A fast HTTP/1.1 load generator for the benchmarks: one thread, epoll.
 * It opens --concurrency keep-alive connections to one URL and sends the
 * same POST on each, back to back, for --duration seconds (or until every
 * connection has sent --max-requests), then waits for the requests in flight.
 * Responses are parsed (Content-Length, chunked, or until close), and for
 * each request it records the latency to the end of the body, the time to
 * the first body byte and the non-empty body lines.  With --delays, every
 * body line carrying "t":NS (CLOCK_MONOTONIC nanoseconds, as bench/native/
 * engine.c writes) adds how late it arrived.  A connection the server closes
 * is reopened.  Prints one JSON document:
 *
 *   {"ok":N,"errors":N,"error_kinds":{...},"elapsed":S,"cpu":S,
 *    "lines":N,"connects":N,"lat_us":[...],"ttfb_us":[...],"delay_us":[...]}
 *
 *   loadgen --url http://127.0.0.1:PORT/api/chat --body JSON
 *           [--concurrency 1] [--duration 1] [--timeout 30]
 *           [--max-requests 0] [--delays]
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

typedef struct { double *v; size_t n, cap; } vec;

static void push(vec *a, double x) {
    if (a->n == a->cap) {
        a->cap = a->cap ? a->cap * 2 : 1024;
        a->v = realloc(a->v, a->cap * sizeof *a->v);
    }
    a->v[a->n++] = x;
}

enum state { S_IDLE, S_CONNECTING, S_SENDING, S_HEAD, S_BODY };
enum framing { F_LENGTH, F_CHUNKED, F_CLOSE };

typedef struct {
    int fd;
    enum state st;
    size_t sent;
    char buf[65536];
    size_t len;
    int status;
    enum framing framing;
    long remaining;      /* F_LENGTH: body bytes left; F_CHUNKED: of this chunk */
    int chunk_state;     /* 0 size line, 1 data, 2 CRLF after data, 3 trailers */
    int keep_alive;
    int requests;
    int64_t start, first;
    long lines;
    int line_len;        /* bytes of the current line so far */
    char line[512];      /* its start, for "t": */
} conn;

static struct sockaddr_in g_addr;
static char *g_request;
static size_t g_request_len;
static int g_delays, g_max_requests;
static int64_t g_deadline, g_timeout_ns;
static vec g_lat, g_ttfb, g_delay;
static long g_ok, g_lines, g_connects;
static int g_ep;
static struct { const char *kind; long n; } g_kinds[32];
static int g_nkinds;
static long g_errors;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void error_kind(const char *kind) {
    g_errors++;
    for (int i = 0; i < g_nkinds; i++)
        if (!strcmp(g_kinds[i].kind, kind)) {
            g_kinds[i].n++;
            return;
        }
    if (g_nkinds < 32) {
        g_kinds[g_nkinds].kind = strdup(kind);
        g_kinds[g_nkinds++].n = 1;
    }
}

static void drop(conn *c) {
    if (c->fd >= 0) {
        epoll_ctl(g_ep, EPOLL_CTL_DEL, c->fd, NULL);
        close(c->fd);
    }
    c->fd = -1;
    c->st = S_IDLE;
}

static int may_start(conn *c, int64_t now) {
    return now < g_deadline && (!g_max_requests || c->requests < g_max_requests);
}

static void arm(conn *c, uint32_t events) {
    struct epoll_event ev = {.events = events, .data.ptr = c};
    epoll_ctl(g_ep, EPOLL_CTL_MOD, c->fd, &ev);
}

static int try_send(conn *c);

/* Starts the next request on c (connecting first when needed). */
static void start_request(conn *c) {
    c->start = now_ns();
    c->first = 0;
    c->lines = 0;
    c->line_len = 0;
    c->len = 0;
    c->sent = 0;
    c->status = 0;
    c->requests++;
    if (c->fd < 0) {
        c->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        int one = 1;
        setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        g_connects++;
        struct epoll_event ev = {.events = EPOLLOUT, .data.ptr = c};
        epoll_ctl(g_ep, EPOLL_CTL_ADD, c->fd, &ev);
        if (connect(c->fd, (struct sockaddr *)&g_addr, sizeof g_addr) < 0 &&
            errno != EINPROGRESS) {
            error_kind("connect");
            drop(c);
            return;
        }
        c->st = S_CONNECTING;
        return;
    }
    c->st = S_SENDING;
    if (try_send(c) < 0) {
        error_kind("send");
        drop(c);
    }
}

static int try_send(conn *c) {
    while (c->sent < g_request_len) {
        ssize_t n = send(c->fd, g_request + c->sent, g_request_len - c->sent,
                         MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) {
                arm(c, EPOLLOUT);
                return 0;
            }
            return -1;
        }
        c->sent += (size_t)n;
    }
    c->st = S_HEAD;
    arm(c, EPOLLIN);
    return 0;
}

static void finish(conn *c, int64_t now) {
    if (c->status == 200) {
        g_ok++;
        push(&g_lat, (double)(now - c->start) / 1e3);
        push(&g_ttfb, (double)((c->first ? c->first : now) - c->start) / 1e3);
        g_lines += c->lines;
    } else {
        char kind[32];
        snprintf(kind, sizeof kind, "HTTP %d", c->status);
        error_kind(kind);
    }
    if (!c->keep_alive) drop(c);
    c->st = S_IDLE;
}

/* Body bytes: first-byte time, lines, chunk delays. */
static void body_bytes(conn *c, const char *p, size_t n, int64_t now) {
    if (!n) return;
    if (!c->first) c->first = now;
    for (size_t i = 0; i < n; i++) {
        char ch = p[i];
        if (ch == '\n') {
            if (c->line_len) {
                c->lines++;
                if (g_delays) {
                    size_t have = c->line_len < (int)sizeof c->line ? (size_t)c->line_len
                                                                   : sizeof c->line;
                    char *t = memmem(c->line, have, "\"t\":", 4);
                    if (t) {
                        long long sent = strtoll(t + 4, NULL, 10);
                        if (sent > 0) push(&g_delay, (double)(now - sent) / 1e3);
                    }
                }
            }
            c->line_len = 0;
        } else {
            if (c->line_len < (int)sizeof c->line - 1) c->line[c->line_len] = ch;
            c->line_len++;
            if (c->line_len < (int)sizeof c->line) c->line[c->line_len] = 0;
        }
    }
}

/* Consumes the body part of c->buf; returns 1 when the response is done. */
static int parse_body(conn *c, int64_t now) {
    size_t i = 0;
    int done = 0;
    while (i < c->len && !done) {
        if (c->framing == F_CLOSE) {
            body_bytes(c, c->buf + i, c->len - i, now);
            i = c->len;
        } else if (c->framing == F_LENGTH) {
            size_t take = c->len - i < (size_t)c->remaining ? c->len - i
                                                            : (size_t)c->remaining;
            body_bytes(c, c->buf + i, take, now);
            i += take;
            c->remaining -= (long)take;
            if (!c->remaining) done = 1;
        } else if (c->chunk_state == 1) {
            size_t take = c->len - i < (size_t)c->remaining ? c->len - i
                                                            : (size_t)c->remaining;
            body_bytes(c, c->buf + i, take, now);
            i += take;
            c->remaining -= (long)take;
            if (!c->remaining) c->chunk_state = 2;
        } else {
            char *eol = memmem(c->buf + i, c->len - i, "\r\n", 2);
            if (!eol) break;
            size_t line = (size_t)(eol - (c->buf + i));
            if (c->chunk_state == 0) {
                c->remaining = strtol(c->buf + i, NULL, 16);
                c->chunk_state = c->remaining ? 1 : 3;
            } else if (c->chunk_state == 2) {
                c->chunk_state = 0;
            } else if (line == 0) { /* end of trailers */
                done = 1;
            }
            i += line + 2;
        }
    }
    memmove(c->buf, c->buf + i, c->len - i);
    c->len -= i;
    if (c->framing == F_LENGTH && c->remaining == 0) done = 1;
    return done;
}

/* Parses the status line and headers; returns 1 once they are complete. */
static int parse_head(conn *c) {
    char *end = memmem(c->buf, c->len, "\r\n\r\n", 4);
    if (!end) return 0;
    *end = 0;
    c->status = 0;
    int minor = 1;
    sscanf(c->buf, "HTTP/1.%d %d", &minor, &c->status);
    c->keep_alive = minor >= 1;
    c->framing = F_CLOSE;
    c->remaining = 0;
    c->chunk_state = 0;
    for (char *line = strstr(c->buf, "\r\n"); line && line < end;) {
        line += 2;
        if (!strncasecmp(line, "content-length:", 15)) {
            c->framing = F_LENGTH;
            c->remaining = atol(line + 15);
        } else if (!strncasecmp(line, "transfer-encoding:", 18) &&
                   strcasestr(line, "chunked")) {
            c->framing = F_CHUNKED;
        } else if (!strncasecmp(line, "connection:", 11)) {
            if (strcasestr(line, "close")) c->keep_alive = 0;
            else if (strcasestr(line, "keep-alive")) c->keep_alive = 1;
        }
        line = strstr(line, "\r\n");
    }
    if (c->framing == F_CLOSE) c->keep_alive = 0;
    size_t head = (size_t)(end - c->buf) + 4;
    memmove(c->buf, c->buf + head, c->len - head);
    c->len -= head;
    c->st = S_BODY;
    return 1;
}

static void on_event(conn *c, uint32_t events, int64_t now) {
    if (c->st == S_CONNECTING) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) {
            error_kind("connect");
            drop(c);
            return;
        }
        c->st = S_SENDING;
    }
    if (c->st == S_SENDING) {
        if (try_send(c) < 0) {
            error_kind("send");
            drop(c);
        }
        return;
    }
    if (!(events & (EPOLLIN | EPOLLHUP | EPOLLERR))) return;
    for (;;) {
        ssize_t n = recv(c->fd, c->buf + c->len, sizeof c->buf - c->len, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) return;
            error_kind("reset");
            drop(c);
            return;
        }
        if (n == 0) {
            if (c->st == S_BODY && c->framing == F_CLOSE) {
                finish(c, now);
                drop(c);
            } else {
                error_kind(c->st == S_HEAD && c->len == 0 ? "closed" : "truncated");
                drop(c);
            }
            return;
        }
        c->len += (size_t)n;
        if (c->st == S_HEAD) {
            if (!parse_head(c)) {
                if (c->len == sizeof c->buf) {
                    error_kind("head too long");
                    drop(c);
                    return;
                }
                continue;
            }
        }
        if (c->st == S_BODY && parse_body(c, now)) {
            finish(c, now);
            if (c->fd >= 0 && c->len) { /* bytes past the response */
                error_kind("extra bytes");
                drop(c);
            }
            return;
        }
    }
}

static void usage(void) {
    fprintf(stderr, "usage: loadgen --url http://HOST:PORT/PATH --body JSON "
                    "[--concurrency N] [--duration S] [--timeout S] "
                    "[--max-requests N] [--delays]\n");
    exit(2);
}

static void print_vec(const char *name, vec *a) {
    printf(",\"%s\":[", name);
    for (size_t i = 0; i < a->n; i++) printf(i ? ",%.1f" : "%.1f", a->v[i]);
    printf("]");
}

int main(int argc, char **argv) {
    const char *url = NULL, *body = "";
    int concurrency = 1;
    double duration = 1.0, timeout = 30.0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--delays")) {
            g_delays = 1;
            continue;
        }
        if (i + 1 >= argc) usage();
        const char *v = argv[++i];
        if (!strcmp(a, "--url")) url = v;
        else if (!strcmp(a, "--body")) body = v;
        else if (!strcmp(a, "--concurrency")) concurrency = atoi(v);
        else if (!strcmp(a, "--duration")) duration = atof(v);
        else if (!strcmp(a, "--timeout")) timeout = atof(v);
        else if (!strcmp(a, "--max-requests")) g_max_requests = atoi(v);
        else usage();
    }
    if (!url || strncmp(url, "http://", 7) || concurrency < 1) usage();
    char host[256];
    int port = 80;
    const char *hp = url + 7, *slash = strchr(hp, '/');
    const char *path = slash ? slash : "/";
    size_t hl = (size_t)((slash ? slash : hp + strlen(hp)) - hp);
    if (hl >= sizeof host) usage();
    memcpy(host, hp, hl);
    host[hl] = 0;
    char *colon = strchr(host, ':');
    if (colon) {
        port = atoi(colon + 1);
        *colon = 0;
    }
    g_addr.sin_family = AF_INET;
    g_addr.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &g_addr.sin_addr) != 1) usage();
    size_t blen = strlen(body);
    g_request = malloc(blen + 1024);
    g_request_len = (size_t)snprintf(
        g_request, blen + 1024,
        "POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
        "Content-Length: %zu\r\n\r\n%s",
        path, host, port, blen, body);
    signal(SIGPIPE, SIG_IGN);
    g_ep = epoll_create1(0);
    conn *conns = calloc((size_t)concurrency, sizeof *conns);
    int64_t begin = now_ns();
    g_deadline = begin + (int64_t)(duration * 1e9);
    g_timeout_ns = (int64_t)(timeout * 1e9);
    for (int i = 0; i < concurrency; i++) {
        conns[i].fd = -1;
        start_request(&conns[i]);
    }
    struct epoll_event events[512];
    for (;;) {
        int64_t now = now_ns();
        int busy = 0;
        for (int i = 0; i < concurrency; i++) {
            conn *c = &conns[i];
            if (c->st != S_IDLE && now - c->start > g_timeout_ns) {
                error_kind("timeout");
                drop(c);
            }
            if (c->st == S_IDLE && may_start(c, now)) start_request(c);
            if (c->st != S_IDLE) busy = 1;
        }
        if (!busy) break;
        int n = epoll_wait(g_ep, events, 512, 50);
        now = now_ns();
        for (int i = 0; i < n; i++) {
            conn *c = events[i].data.ptr;
            if (c->fd < 0) continue;
            on_event(c, events[i].events, now);
            if (c->st == S_IDLE && may_start(c, now)) start_request(c);
        }
    }
    double elapsed = (double)(now_ns() - begin) / 1e9;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
                 (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
    printf("{\"ok\":%ld,\"errors\":%ld,\"error_kinds\":{", g_ok, g_errors);
    for (int i = 0; i < g_nkinds; i++)
        printf("%s\"%s\":%ld", i ? "," : "", g_kinds[i].kind, g_kinds[i].n);
    printf("},\"elapsed\":%.6f,\"cpu\":%.6f,\"lines\":%ld,\"connects\":%ld", elapsed, cpu,
           g_lines, g_connects);
    print_vec("lat_us", &g_lat);
    print_vec("ttfb_us", &g_ttfb);
    print_vec("delay_us", &g_delay);
    printf("}\n");
    return 0;
}
