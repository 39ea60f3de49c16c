/*
 * A fast fake LLM engine for the benchmarks: one thread, epoll, HTTP/1.1
 * keep-alive (HTTP/1.0 and "Connection: close" answered without chunking,
 * then closed).  It speaks just enough of two dialects:
 *
 *   GET  /api/tags              Ollama model list
 *   GET  /v1/models             OpenAI model list
 *   GET  /bench/stats           requests served per path, as JSON
 *   POST /api/chat              Ollama chat: one JSON document ("stream":
 *                               false) or NDJSON, one HTTP chunk per line
 *   POST /v1/chat/completions   OpenAI chat: one JSON document, or SSE with
 *                               "stream": true, ending "data: [DONE]"
 *
 * A streamed answer has --chunks tokens (or the request's "num_predict" /
 * "max_tokens") plus a final line; a plain one has --plain-chunks tokens.
 * With --interval-ms the tokens of a stream are written that far apart (the
 * first one with the headers), one write each; without it they go back to
 * back, each its own HTTP chunk, sent about 8 KB at a time.  Every streamed line carries "t": the
 * CLOCK_MONOTONIC nanoseconds when it was written, so a client on the same
 * machine can measure how late each chunk arrives.
 *
 *   engine [--host 127.0.0.1] [--port 0] [--models a,b] [--chunks 200]
 *          [--plain-chunks 5] [--interval-ms 0]
 *
 * Prints "listening on HOST:PORT" once ready; runs until SIGTERM/SIGINT.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_HEAD 16384
#define MAX_EVENTS 256

enum kind { K_NONE, K_OLLAMA, K_OPENAI };

typedef struct conn {
    int fd;
    char *in;           /* request bytes not yet consumed */
    size_t in_len, in_cap;
    char *out;          /* response bytes not yet sent */
    size_t out_off, out_len, out_cap;
    int want_out;       /* registered for EPOLLOUT */
    int close_after;    /* close once out is flushed and the answer is done */
    /* a streaming answer in progress */
    int streaming;
    enum kind kind;
    int chunked;        /* HTTP/1.1 chunked framing */
    int left;           /* tokens still to send */
    int index;          /* tokens sent */
    int64_t due;        /* ns: when the next token is due (paced) */
    struct conn *next_active, *prev_active;
} conn;

static const char *g_models[64];
static int g_nmodels;
static int g_chunks = 200, g_plain = 5;
static int64_t g_interval_ns;
static volatile sig_atomic_t g_stop;
static int g_ep;
static long g_count_tags, g_count_models, g_count_chat, g_count_openai;
static conn *g_active; /* streaming connections */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void on_signal(int sig) { (void)sig; g_stop = 1; }

static void out_reserve(conn *c, size_t extra) {
    if (c->out_off && c->out_off == c->out_len) c->out_off = c->out_len = 0;
    if (c->out_len + extra <= c->out_cap) return;
    if (c->out_off) {
        memmove(c->out, c->out + c->out_off, c->out_len - c->out_off);
        c->out_len -= c->out_off;
        c->out_off = 0;
        if (c->out_len + extra <= c->out_cap) return;
    }
    size_t cap = c->out_cap ? c->out_cap : 4096;
    while (cap < c->out_len + extra) cap *= 2;
    c->out = realloc(c->out, cap);
    c->out_cap = cap;
}

static void out_add(conn *c, const char *data, size_t n) {
    out_reserve(c, n);
    memcpy(c->out + c->out_len, data, n);
    c->out_len += n;
}

/* Adds one body part, framed as an HTTP chunk when the answer is chunked. */
static void out_part(conn *c, const char *data, size_t n) {
    char head[32];
    if (c->chunked) {
        int h = snprintf(head, sizeof head, "%zx\r\n", n);
        out_add(c, head, (size_t)h);
    }
    out_add(c, data, n);
    if (c->chunked) out_add(c, "\r\n", 2);
}

static void set_events(conn *c, int want_out) {
    if (c->want_out == want_out) return;
    struct epoll_event ev = {.events = EPOLLIN | (want_out ? EPOLLOUT : 0),
                             .data.ptr = c};
    epoll_ctl(g_ep, EPOLL_CTL_MOD, c->fd, &ev);
    c->want_out = want_out;
}

static void unlink_active(conn *c) {
    if (c->prev_active) c->prev_active->next_active = c->next_active;
    else if (g_active == c) g_active = c->next_active;
    if (c->next_active) c->next_active->prev_active = c->prev_active;
    c->next_active = c->prev_active = NULL;
}

static void conn_close(conn *c) {
    if (c->streaming) unlink_active(c);
    epoll_ctl(g_ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    free(c->in);
    free(c->out);
    free(c);
}

/* Sends what it can; returns -1 when the connection is gone. */
static int flush_out(conn *c) {
    while (c->out_off < c->out_len) {
        ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off,
                         MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                set_events(c, 1);
                return 0;
            }
            return -1;
        }
        c->out_off += (size_t)n;
    }
    c->out_off = c->out_len = 0;
    set_events(c, 0);
    if (c->close_after && !c->streaming) {
        shutdown(c->fd, SHUT_WR);
        return -1;
    }
    return 0;
}

static const char *model_of(const char *body, size_t n, char *buf, size_t cap) {
    const char *p = memmem(body, n, "\"model\"", 7);
    if (p) {
        p = memchr(p + 7, '"', (size_t)(body + n - (p + 7)));
        if (p) {
            const char *e = memchr(p + 1, '"', (size_t)(body + n - (p + 1)));
            if (e && (size_t)(e - p - 1) < cap) {
                memcpy(buf, p + 1, (size_t)(e - p - 1));
                buf[e - p - 1] = 0;
                return buf;
            }
        }
    }
    snprintf(buf, cap, "%s", g_nmodels ? g_models[0] : "bench-model");
    return buf;
}

/* The value of "key": true/false in the body; dflt when absent. */
static int bool_field(const char *body, size_t n, const char *key, int dflt) {
    size_t k = strlen(key);
    const char *p = memmem(body, n, key, k);
    if (!p) return dflt;
    p += k;
    while (p < body + n && (*p == ' ' || *p == ':' || *p == '\t')) p++;
    if (p + 4 <= body + n && !memcmp(p, "true", 4)) return 1;
    if (p + 5 <= body + n && !memcmp(p, "false", 5)) return 0;
    return dflt;
}

static int int_field(const char *body, size_t n, const char *key, int dflt) {
    size_t k = strlen(key);
    const char *p = memmem(body, n, key, k);
    if (!p) return dflt;
    p += k;
    while (p < body + n && (*p == ' ' || *p == ':' || *p == '\t')) p++;
    if (p >= body + n || *p < '0' || *p > '9') return dflt;
    int v = 0;
    while (p < body + n && *p >= '0' && *p <= '9') v = v * 10 + (*p++ - '0');
    return v;
}

static void respond(conn *c, int code, const char *type, const char *body,
                    size_t n) {
    char head[512];
    const char *reason = code == 200 ? "OK" : code == 404 ? "Not Found"
                                                          : "Bad Request";
    int h = snprintf(head, sizeof head,
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\n"
                     "Content-Length: %zu\r\n%s\r\n",
                     code, reason, type, n,
                     c->close_after ? "Connection: close\r\n" : "");
    out_add(c, head, (size_t)h);
    out_add(c, body, n);
}

static char g_model[256];

static void stream_token(conn *c) {
    char line[768];
    int n;
    int64_t t = now_ns();
    if (c->kind == K_OLLAMA) {
        if (c->left > 0)
            n = snprintf(line, sizeof line,
                         "{\"model\":\"%s\",\"created_at\":\"2024-01-01T00:00:00Z\","
                         "\"message\":{\"role\":\"assistant\",\"content\":\"tok%d \"},"
                         "\"done\":false,\"t\":%lld}\n",
                         g_model, c->index, (long long)t);
        else
            n = snprintf(line, sizeof line,
                         "{\"model\":\"%s\",\"created_at\":\"2024-01-01T00:00:00Z\","
                         "\"message\":{\"role\":\"assistant\",\"content\":\"\"},"
                         "\"done\":true,\"done_reason\":\"stop\",\"eval_count\":%d,"
                         "\"t\":%lld}\n",
                         g_model, c->index, (long long)t);
    } else {
        if (c->left > 0)
            n = snprintf(line, sizeof line,
                         "data: {\"id\":\"chatcmpl-bench\",\"object\":"
                         "\"chat.completion.chunk\",\"created\":0,\"model\":\"%s\","
                         "\"choices\":[{\"index\":0,\"delta\":{\"content\":"
                         "\"tok%d \"},\"finish_reason\":null}],\"t\":%lld}\n\n",
                         g_model, c->index, (long long)t);
        else
            n = snprintf(line, sizeof line,
                         "data: {\"id\":\"chatcmpl-bench\",\"object\":"
                         "\"chat.completion.chunk\",\"created\":0,\"model\":\"%s\","
                         "\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":"
                         "\"stop\"}],\"t\":%lld}\n\n",
                         g_model, (long long)t);
    }
    out_part(c, line, (size_t)n);
    if (c->left == 0 && c->kind == K_OPENAI) out_part(c, "data: [DONE]\n\n", 14);
    if (c->left == 0) {
        if (c->chunked) out_add(c, "0\r\n\r\n", 5);
        c->streaming = 0;
        unlink_active(c);
    } else {
        c->left--;
        c->index++;
    }
}

/* Writes the tokens that are due; returns -1 when the connection is gone. */
static int stream_step(conn *c, int64_t now) {
    while (c->streaming) {
        if (g_interval_ns && c->due > now) break;
        stream_token(c);
        if (g_interval_ns) c->due += g_interval_ns;
        /* paced tokens go out one write each; back-to-back ones are still one
         * HTTP chunk each, but sent in batches of about 8 KB, so the engine's
         * syscalls do not cap the rate a proxy is measured at */
        if (!g_interval_ns && c->streaming && c->out_len - c->out_off < 8192) continue;
        if (flush_out(c) < 0) return -1;
        if (c->want_out) break; /* the socket is full: wait for EPOLLOUT */
    }
    if (!c->streaming && c->close_after && c->out_len == 0) {
        shutdown(c->fd, SHUT_WR);
        return -1;
    }
    return 0;
}

static void begin_stream(conn *c, enum kind kind, int tokens) {
    char head[256];
    c->kind = kind;
    c->chunked = !c->close_after;
    c->left = tokens;
    c->index = 0;
    int h = snprintf(head, sizeof head, "HTTP/1.1 200 OK\r\nContent-Type: %s\r\n%s\r\n",
                     kind == K_OLLAMA ? "application/x-ndjson" : "text/event-stream",
                     c->chunked ? "Transfer-Encoding: chunked\r\n"
                                : "Connection: close\r\n");
    out_add(c, head, (size_t)h);
    c->streaming = 1;
    c->due = now_ns();
    c->next_active = g_active;
    c->prev_active = NULL;
    if (g_active) g_active->prev_active = c;
    g_active = c;
}

static void plain_answer(conn *c, enum kind kind, const char *model) {
    char content[4096] = "";
    size_t used = 0;
    for (int i = 0; i < g_plain && used + 16 < sizeof content; i++)
        used += (size_t)snprintf(content + used, sizeof content - used, "tok%d ", i);
    char body[6144];
    int n;
    if (kind == K_OLLAMA)
        n = snprintf(body, sizeof body,
                     "{\"model\":\"%s\",\"created_at\":\"2024-01-01T00:00:00Z\","
                     "\"message\":{\"role\":\"assistant\",\"content\":\"%s\"},"
                     "\"done\":true,\"done_reason\":\"stop\",\"eval_count\":%d}",
                     model, content, g_plain);
    else
        n = snprintf(body, sizeof body,
                     "{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion\","
                     "\"created\":0,\"model\":\"%s\",\"choices\":[{\"index\":0,"
                     "\"message\":{\"role\":\"assistant\",\"content\":\"%s\"},"
                     "\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":3,"
                     "\"completion_tokens\":%d,\"total_tokens\":%d}}",
                     model, content, g_plain, g_plain + 3);
    respond(c, 200, "application/json", body, (size_t)n);
}

static void list_models(conn *c, int openai) {
    char body[8192];
    size_t used = (size_t)snprintf(body, sizeof body, openai ? "{\"object\":\"list\",\"data\":["
                                                             : "{\"models\":[");
    for (int i = 0; i < g_nmodels && used + 300 < sizeof body; i++)
        used += (size_t)snprintf(body + used, sizeof body - used,
                                 openai ? "%s{\"id\":\"%s\",\"object\":\"model\"}"
                                        : "%s{\"name\":\"%s\",\"model\":\"%s\"}",
                                 i ? "," : "", g_models[i], g_models[i]);
    used += (size_t)snprintf(body + used, sizeof body - used, "]}");
    respond(c, 200, "application/json", body, used);
}

/* Handles one whole request; body is already de-chunked. */
static void handle(conn *c, const char *method, const char *path, const char *body,
                   size_t n) {
    int post = !strcmp(method, "POST");
    if (!strcmp(path, "/api/tags")) {
        g_count_tags++;
        list_models(c, 0);
    } else if (!strcmp(path, "/v1/models")) {
        g_count_models++;
        list_models(c, 1);
    } else if (!strcmp(path, "/bench/stats")) {
        char out[256];
        int m = snprintf(out, sizeof out,
                         "{\"/api/tags\":%ld,\"/v1/models\":%ld,\"/api/chat\":%ld,"
                         "\"/v1/chat/completions\":%ld}",
                         g_count_tags, g_count_models, g_count_chat, g_count_openai);
        respond(c, 200, "application/json", out, (size_t)m);
    } else if (post && (!strcmp(path, "/api/chat") ||
                        !strcmp(path, "/v1/chat/completions"))) {
        enum kind kind = path[1] == 'a' ? K_OLLAMA : K_OPENAI;
        if (kind == K_OLLAMA) g_count_chat++;
        else g_count_openai++;
        model_of(body, n, g_model, sizeof g_model);
        int stream = bool_field(body, n, "\"stream\"", kind == K_OLLAMA);
        if (stream) {
            int tokens = int_field(body, n, kind == K_OLLAMA ? "\"num_predict\""
                                                             : "\"max_tokens\"",
                                   g_chunks);
            begin_stream(c, kind, tokens);
        } else {
            plain_answer(c, kind, g_model);
        }
    } else {
        respond(c, 404, "application/json", "{\"error\":\"not found\"}", 21);
    }
}

/* Decodes a chunked body in place from src; returns bytes consumed or 0 if
 * incomplete, -1 if malformed.  The decoded body is written to dst. */
static ssize_t dechunk(const char *src, size_t n, char *dst, size_t *out_n) {
    size_t i = 0, o = 0;
    for (;;) {
        const char *eol = memmem(src + i, n - i, "\r\n", 2);
        if (!eol) return 0;
        char *end;
        unsigned long size = strtoul(src + i, &end, 16);
        if (end == src + i) return -1;
        i = (size_t)(eol - src) + 2;
        if (size == 0) {
            const char *fin = memmem(src + i - 2, n - i + 2, "\r\n\r\n", 4);
            if (!fin) return 0;
            *out_n = o;
            return (ssize_t)((size_t)(fin - src) + 4);
        }
        if (i + size + 2 > n) return 0;
        memcpy(dst + o, src + i, size);
        o += size;
        i += size + 2;
    }
}

/* Parses and answers every whole request in c->in; -1: close. */
static int process_input(conn *c) {
    while (c->in_len && !c->streaming && !c->close_after) {
        char *end = memmem(c->in, c->in_len, "\r\n\r\n", 4);
        if (!end) return c->in_len > MAX_HEAD ? -1 : 0;
        size_t head_len = (size_t)(end - c->in) + 4;
        *end = 0; /* the string functions below stay inside the head */
        char method[16], path[1024], version[16];
        if (sscanf(c->in, "%15s %1023s %15s", method, path, version) != 3) return -1;
        char *q = strchr(path, '?');
        if (q) *q = 0;
        long length = 0;
        int chunked = 0, close_conn = !strcmp(version, "HTTP/1.0");
        char *first = strstr(c->in, "\r\n");
        for (char *line = first ? first + 2 : end; line < end;) {
            char *eol = strstr(line, "\r\n");
            if (!eol) eol = end;
            char *found = strcasestr(line, "chunked");
            if (!strncasecmp(line, "content-length:", 15)) length = atol(line + 15);
            else if (!strncasecmp(line, "transfer-encoding:", 18) && found && found < eol)
                chunked = 1;
            else if (!strncasecmp(line, "connection:", 11)) {
                char *v = line + 11;
                while (*v == ' ') v++;
                if (!strncasecmp(v, "close", 5)) close_conn = 1;
                else if (!strncasecmp(v, "keep-alive", 10)) close_conn = 0;
            }
            line = eol + 2;
        }
        size_t used;
        char *body;
        size_t body_len;
        if (chunked) {
            body = malloc(c->in_len - head_len + 1);
            ssize_t r = dechunk(c->in + head_len, c->in_len - head_len, body, &body_len);
            if (r <= 0) {
                free(body);
                return r < 0 ? -1 : 0;
            }
            used = head_len + (size_t)r;
        } else {
            if (length < 0) return -1;
            if (c->in_len < head_len + (size_t)length) return 0;
            body = malloc((size_t)length + 1);
            memcpy(body, c->in + head_len, (size_t)length);
            body_len = (size_t)length;
            used = head_len + (size_t)length;
        }
        c->close_after = close_conn;
        handle(c, method, path, body, body_len);
        free(body);
        memmove(c->in, c->in + used, c->in_len - used);
        c->in_len -= used;
        c->in[c->in_len] = 0;
        if (c->streaming) {
            if (stream_step(c, now_ns()) < 0) return -1;
        } else if (flush_out(c) < 0) {
            return -1;
        }
    }
    return 0;
}

static int on_readable(conn *c) {
    for (;;) {
        if (c->in_cap - c->in_len < 4096) {
            c->in_cap = c->in_cap ? c->in_cap * 2 : 8192;
            c->in = realloc(c->in, c->in_cap);
        }
        size_t room = c->in_cap - c->in_len - 1; /* one byte for the NUL */
        ssize_t n = recv(c->fd, c->in + c->in_len, room, 0);
        if (n == 0) return -1;
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            return -1;
        }
        c->in_len += (size_t)n;
        c->in[c->in_len] = 0;
        if ((size_t)n < room) break; /* drained; epoll is level-triggered */
    }
    return process_input(c);
}

static void add_model(const char *name) {
    if (g_nmodels < 64 && *name) g_models[g_nmodels++] = name;
}

int main(int argc, char **argv) {
    const char *host = "127.0.0.1";
    int port = 0;
    char *models = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "engine: %s needs a value\n", a);
            return 2;
        }
        if (!strcmp(a, "--host")) host = v;
        else if (!strcmp(a, "--port")) port = atoi(v);
        else if (!strcmp(a, "--models")) models = strdup(v);
        else if (!strcmp(a, "--chunks")) g_chunks = atoi(v);
        else if (!strcmp(a, "--plain-chunks")) g_plain = atoi(v);
        else if (!strcmp(a, "--interval-ms")) g_interval_ns = (int64_t)(atof(v) * 1e6);
        else {
            fprintf(stderr, "engine: unknown option %s\n", a);
            return 2;
        }
        i++;
    }
    if (models) {
        for (char *tok = strtok(models, ","); tok; tok = strtok(NULL, ",")) add_model(tok);
    } else {
        add_model("bench-model");
    }
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1) {
        fprintf(stderr, "engine: bad host %s\n", host);
        return 2;
    }
    if (bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(lfd, 4096) < 0) {
        perror("engine: listen");
        return 1;
    }
    socklen_t alen = sizeof addr;
    getsockname(lfd, (struct sockaddr *)&addr, &alen);
    printf("listening on %s:%d\n", host, ntohs(addr.sin_port));
    fflush(stdout);

    g_ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(g_ep, EPOLL_CTL_ADD, lfd, &ev);
    struct epoll_event events[MAX_EVENTS];
    while (!g_stop) {
        int timeout = -1;
        if (g_active) {
            /* the earliest due token of a stream that is not waiting for
             * EPOLLOUT; back-to-back streams are always due */
            int64_t next = INT64_MAX, now = now_ns();
            for (conn *c = g_active; c; c = c->next_active)
                if (!c->want_out && c->due < next) next = g_interval_ns ? c->due : now;
            if (next != INT64_MAX)
                timeout = next <= now ? 0 : (int)((next - now + 999999) / 1000000);
        }
        int n = epoll_wait(g_ep, events, MAX_EVENTS, timeout);
        if (n < 0 && errno != EINTR) break;
        for (int i = 0; i < n; i++) {
            conn *c = events[i].data.ptr;
            if (!c) {
                for (;;) {
                    int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK);
                    if (fd < 0) break;
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    conn *nc = calloc(1, sizeof *nc);
                    nc->fd = fd;
                    struct epoll_event cev = {.events = EPOLLIN, .data.ptr = nc};
                    epoll_ctl(g_ep, EPOLL_CTL_ADD, fd, &cev);
                }
                continue;
            }
            int gone = 0;
            if (events[i].events & (EPOLLERR | EPOLLHUP)) gone = 1;
            if (!gone && (events[i].events & EPOLLOUT)) {
                if (flush_out(c) < 0) gone = 1;
                else if (c->streaming && !c->want_out && stream_step(c, now_ns()) < 0)
                    gone = 1;
                else if (!c->streaming && !c->want_out && process_input(c) < 0)
                    gone = 1;
            }
            if (!gone && (events[i].events & EPOLLIN) && on_readable(c) < 0) gone = 1;
            if (gone) conn_close(c);
        }
        /* advance the streams that are due (or back to back) */
        int64_t now = now_ns();
        for (conn *c = g_active, *next; c; c = next) {
            next = c->next_active;
            if (c->want_out) continue;
            if (stream_step(c, now) < 0) {
                conn_close(c);
                continue;
            }
            if (!c->streaming && process_input(c) < 0) conn_close(c);
        }
    }
    return 0;
}
