/*
 * llama.cpp's single-stream decode speed on one GGUF file, through llama.h alone, for
 * benches/gguf_vs_llamacpp.py. It measures what `llama-bench -p 0 -n TOKENS -t THREADS`
 * measures (its "tg" test): from an empty KV cache, TOKENS calls of llama_decode with one
 * token each (random ids, the logits of that token computed), each waited for, after one
 * warm-up token; an explicit CPU threadpool of THREADS threads, llama.cpp's default
 * context otherwise (f16 KV cache, flash attention "auto", weight repacking on).
 *
 * Why a harness of our own: llama-bench links llama.cpp's `common` library (argument
 * parsing, chat templates, downloads), which takes hours to compile on a shared 2-core
 * machine; this needs only libllama and ggml. benches/build_llamacpp.sh builds both, and
 * the bench runs both where both exist, so the two can be compared.
 *
 * Usage: llamacpp-decode MODEL.gguf TOKENS THREADS REPEATS
 * Prints one JSON object: tokens per second of each repeat and their mean.
 *
 *        llamacpp-decode --top MODEL.gguf K TOKEN_ID...
 * Prints the K most likely next tokens after the prompt TOKEN_ID... with their
 * log-probabilities, so the bench can check that llama.cpp and pyengine read the file
 * alike (the speeds of two engines that compute different models would not compare).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-cpu.h"
#include "llama.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void errors_only(enum ggml_log_level level, const char *text, void *user_data) {
    (void)user_data;
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

/* One token through the model at the next position; 0 on success. */
static int decode_one(struct llama_context *ctx, llama_token token) {
    struct llama_batch batch = llama_batch_get_one(&token, 1);
    int status = llama_decode(ctx, batch);
    llama_synchronize(ctx);
    return status;
}

/* The k most likely next tokens after the prompt ids[0..n), as JSON on stdout. The
 * prompt goes in one token per llama_decode call: on the Intel Xeon development VM
 * (AVX-512, AMX_INT8) llama.cpp crashed (SIGSEGV) decoding a multi-token batch of a Q8_0
 * file, while one token at a time works, and causal attention gives the same logits. */
static int print_top(const char *path, int k, const llama_token *ids, int n) {
    struct llama_model *model = llama_model_load_from_file(path, llama_model_default_params());
    if (model == NULL) {
        fprintf(stderr, "llama.cpp could not load %s\n", path);
        return 1;
    }
    struct llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = (uint32_t)n + 1;
    struct llama_context *ctx = llama_init_from_model(model, cparams);
    if (ctx == NULL) {
        fprintf(stderr, "llama.cpp could not make a context\n");
        return 1;
    }
    for (int i = 0; i < n; i++) {
        if (decode_one(ctx, ids[i]) != 0) {
            fprintf(stderr, "llama.cpp could not decode prompt token %d\n", i);
            return 1;
        }
    }
    int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const float *logits = llama_get_logits_ith(ctx, -1);
    double top = logits[0], sum = 0.0;
    for (int i = 1; i < vocab; i++) {
        top = logits[i] > top ? logits[i] : top;
    }
    for (int i = 0; i < vocab; i++) {
        sum += exp(logits[i] - top);
    }
    double log_norm = top + log(sum);
    int *chosen = calloc((size_t)vocab, sizeof(int));
    printf("{\"top\": [");
    for (int j = 0; j < k && j < vocab; j++) {
        int best = -1;
        for (int i = 0; i < vocab; i++) {
            if (!chosen[i] && (best < 0 || logits[i] > logits[best])) {
                best = i;
            }
        }
        chosen[best] = 1;
        printf("%s[%d, %.6f]", j ? ", " : "", best, logits[best] - log_norm);
    }
    printf("]}\n");
    free(chosen);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 5 && strcmp(argv[1], "--top") == 0) {
        llama_log_set(errors_only, NULL);
        llama_backend_init();
        int n = argc - 4;
        llama_token *ids = malloc(sizeof(llama_token) * (size_t)n);
        for (int i = 0; i < n; i++) {
            ids[i] = atoi(argv[4 + i]);
        }
        int status = print_top(argv[2], atoi(argv[3]), ids, n);
        free(ids);
        return status;
    }
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL.gguf TOKENS THREADS REPEATS\n       %s --top MODEL.gguf K TOKEN_ID...\n",
                argv[0], argv[0]);
        return 2;
    }
    const char *path = argv[1];
    int tokens = atoi(argv[2]), threads = atoi(argv[3]), repeats = atoi(argv[4]);
    if (tokens < 1 || threads < 1 || repeats < 1) {
        fprintf(stderr, "TOKENS, THREADS and REPEATS must be positive integers\n");
        return 2;
    }
    llama_log_set(errors_only, NULL);
    llama_backend_init();

    struct llama_model *model = llama_model_load_from_file(path, llama_model_default_params());
    if (model == NULL) {
        fprintf(stderr, "llama.cpp could not load %s\n", path);
        return 1;
    }
    struct llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = (uint32_t)tokens + 1;
    cparams.n_threads = threads;
    cparams.n_threads_batch = threads;
    cparams.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, cparams);
    if (ctx == NULL) {
        fprintf(stderr, "llama.cpp could not create a context for %s\n", path);
        llama_model_free(model);
        return 1;
    }
    struct ggml_threadpool_params pool_params = ggml_threadpool_params_default(threads);
    struct ggml_threadpool *pool = ggml_threadpool_new(&pool_params);
    if (pool == NULL) {
        fprintf(stderr, "could not create a threadpool of %d threads\n", threads);
        return 1;
    }
    llama_attach_threadpool(ctx, pool, NULL);

    int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    srand(1);
    if (decode_one(ctx, rand() % vocab) != 0) {
        fprintf(stderr, "llama_decode failed on the warm-up token\n");
        return 1;
    }
    double sum = 0.0;
    printf("{\"tokens_per_s\": [");
    for (int r = 0; r < repeats; r++) {
        llama_memory_clear(llama_get_memory(ctx), false);
        double start = now_s();
        for (int i = 0; i < tokens; i++) {
            if (decode_one(ctx, rand() % vocab) != 0) {
                fprintf(stderr, "llama_decode failed at token %d\n", i);
                return 1;
            }
        }
        double rate = tokens / (now_s() - start);
        sum += rate;
        printf("%s%.3f", r ? ", " : "", rate);
    }
    printf("], \"avg_ts\": %.3f, \"threads\": %d, \"tokens\": %d, \"model_bytes\": %llu, \"system_info\": \"%s\"}\n",
           sum / repeats, threads, tokens, (unsigned long long)llama_model_size(model), llama_print_system_info());

    llama_free(ctx);
    ggml_threadpool_free(pool);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
