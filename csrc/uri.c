/* uri.c: a URI string made into a mongoc_uri_t, its errors returned.
 *
 * libmongoc refuses some URIs (an empty host, a port or an integer option
 * that does not parse, options without the '/' before them) but first logs
 * why through its process-wide log handler, which prints it on stderr, and
 * returns a vaguer message ("Invalid host string in URI").  Those cases
 * are checked here first and refused with libmongoc's own words, without
 * the line on stderr.  The checks only refuse what libmongoc refuses:
 * everything else is left to it. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "mongotx.h"

/* libmongoc's integer options (mongoc-uri.h), lowercase as it compares
 * them; wtimeoutms is 64-bit, the others 32-bit. */
static const char *const int_options[] = {
	MONGOC_URI_CONNECTTIMEOUTMS,	     MONGOC_URI_HEARTBEATFREQUENCYMS,
	MONGOC_URI_LOCALTHRESHOLDMS,	     MONGOC_URI_MAXIDLETIMEMS,
	MONGOC_URI_MAXPOOLSIZE,		     MONGOC_URI_MAXSTALENESSSECONDS,
	MONGOC_URI_MINPOOLSIZE,		     MONGOC_URI_SERVERSELECTIONTIMEOUTMS,
	MONGOC_URI_SOCKETCHECKINTERVALMS,    MONGOC_URI_SOCKETTIMEOUTMS,
	MONGOC_URI_SRVMAXHOSTS,		     MONGOC_URI_WAITQUEUEMULTIPLE,
	MONGOC_URI_WAITQUEUETIMEOUTMS,	     MONGOC_URI_WTIMEOUTMS,
	MONGOC_URI_ZLIBCOMPRESSIONLEVEL,     NULL};

static int
is_int_option(const char *key, size_t len)
{
	int i;

	for (i = 0; int_options[i]; i++)
		if (strlen(int_options[i]) == len &&
		    !strncasecmp(key, int_options[i], len))
			return 1;
	return 0;
}

/* 1 when value[0..len) is an integer in the option's range (an empty
 * value is libmongoc's to skip). */
static int
parses(const char *key, const char *value, size_t len)
{
	char buf[32], *end;
	long long v;

	if (len == 0)
		return 1;
	if (len >= sizeof buf)
		return 0;
	memcpy(buf, value, len);
	buf[len] = '\0';
	errno = 0;
	v = strtoll(buf, &end, 10);
	if (errno || *end || end == buf)
		return 0;
	if (strncasecmp(key, MONGOC_URI_WTIMEOUTMS, strlen(MONGOC_URI_WTIMEOUTMS)))
		return v >= INT32_MIN && v <= INT32_MAX;
	return 1;
}

/* 1 when every integer option of the query of uristr (after the '?' that
 * follows the host list's '/'; options split at '&' or ';') parses, else
 * 0 with err set. */
static int
check_int_options(const char *uristr, bson_error_t *err)
{
	const char *p, *key, *eq, *end;

	if (!(p = strstr(uristr, "://")) || !(p = strchr(p + 3, '/')) ||
	    !(p = strchr(p, '?')))
		return 1;
	for (key = p + 1; *key; key = *end ? end + 1 : end) {
		end = key + strcspn(key, "&;");
		if (!(eq = memchr(key, '=', (size_t)(end - key))))
			continue;
		if (!is_int_option(key, (size_t)(eq - key)) ||
		    parses(key, eq + 1, (size_t)(end - eq - 1)))
			continue;
		bson_set_error(err, MONGOC_ERROR_COMMAND,
			       MONGOC_ERROR_COMMAND_INVALID_ARG,
			       "Unsupported value for \"%.*s\": \"%.*s\": not "
			       "an integer in range",
			       (int)(eq - key), key, (int)(end - eq - 1),
			       eq + 1);
		return 0;
	}
	return 1;
}

static int
bad_uri(bson_error_t *err, const char *why, int len, const char *what)
{
	bson_set_error(err, MONGOC_ERROR_COMMAND,
		       MONGOC_ERROR_COMMAND_INVALID_ARG, "%s \"%.*s\"", why,
		       len, what);
	return 0;
}

/* 1 when the port of the host h[0..len) (after its last ':', or after
 * "]:" for an IPv6 address) is absent or a number libmongoc takes. */
static int
port_parses(const char *h, size_t len)
{
	const char *c = h + len;
	long port = 0;

	while (c > h && c[-1] != ':' && c[-1] != ']')
		c--;
	if (c == h || c[-1] != ':' || (*h != '[' && memchr(h, ':', (size_t)(c - 1 - h))))
		return 1; /* no port, or an IPv6 address without brackets */
	if (c == h + len)
		return 1; /* "h:": libmongoc's to judge */
	for (; c < h + len; c++) {
		if (*c < '0' || *c > '9' || (port = port * 10 + (*c - '0')) > 65535)
			return 0;
	}
	return 1;
}

/* 1 when the host list of uristr (after the scheme and any user info, up
 * to the first '/') has no empty host, no '?' and no port that does not
 * parse, else 0 with err set. */
static int
check_hosts(const char *uristr, bson_error_t *err)
{
	const char *p, *end, *at, *h, *comma;

	if (!(p = strstr(uristr, "://")))
		return 1;
	p += 3;
	end = p + strcspn(p, "/");
	if ((at = memchr(p, '@', (size_t)(end - p))))
		p = at + 1;
	if (memchr(p, '?', (size_t)(end - p)))
		return bad_uri(err, "A '/' is required between the host list and "
			       "any options in", (int)(end - p), p);
	for (h = p;; h = comma + 1) {
		if (!(comma = memchr(h, ',', (size_t)(end - h))))
			comma = end;
		if (comma == h)
			return bad_uri(err, "Empty hostname in URI host list",
				       (int)(end - p), p);
		if (!port_parses(h, (size_t)(comma - h)))
			return bad_uri(err, "Port could not be parsed in host",
				       (int)(comma - h), h);
		if (comma == end)
			return 1;
	}
}

mongoc_uri_t *
mtx_uri_new(const char *uristr, bson_error_t *err)
{
	if (!check_hosts(uristr, err) || !check_int_options(uristr, err))
		return NULL;
	return mongoc_uri_new_with_error(uristr, err);
}
