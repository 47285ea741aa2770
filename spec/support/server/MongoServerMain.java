// Test server for mongotx's specs: a de.bwaldvogel mongo-java-server (1.47.0)
// on 127.0.0.1.  Built and run by spec/support/setup.sh and
// spec/support/server.lua; see DESIGN.md section 9.
//
// Usage:
//   java -cp CLASSES:CLASSPATH MongoServerMain [--port N] [--durability MODE] memory
//   java -cp CLASSES:CLASSPATH MongoServerMain [--port N] [--durability MODE] h2 FILE
//
// Prints "PORT <n>" (the bound port; --port 0, the default, lets the OS
// choose) and "VERSION mongo-java-server <v>" on stdout, then serves until
// SIGTERM/SIGINT or until its stdin reaches EOF, so that a server started by
// a Lua process through a pipe dies with that process.
//
// Durability of the h2 backend (checked against the 1.47.0 / H2 2.3.232
// sources):
//  - H2Backend never commits its MVStore by itself.  MVStore.open(file) keeps
//    H2's default auto-commit: a background thread writes the changes every
//    autoCommitDelay = 1000 ms (or earlier when ~1 MB of unsaved changes pile
//    up).  So with the stock setup an acknowledged write is lost by kill -9
//    if it came less than ~1 s before the kill.  autoCommitDelay 0 does NOT
//    mean "commit at once": it disables auto-commit altogether.
//  - Hence MODE (default "commit"): after every command, before the reply is
//    sent, this server calls MVStore.commit(), which writes the new chunk to
//    the file (a write(2): it survives kill -9 of the JVM, not a power cut).
//    commit() is cheap when nothing changed.  "sync" also calls
//    MVStore.sync() (fsync) after a commit that wrote something: survives
//    a power cut too, slower.  "background" keeps H2's 1 s auto-commit
//    (the stock behaviour, for comparison).
//  - Commands run concurrently (one thread per connection); a commit stores
//    everything written so far, including other connections' writes.
//
// The _id index of the memory backend: mongo-java-server uses an index
// only for a query whose keys are exactly the index's keys
// (AbstractUniqueIndex.canHandle compares the key sets), so {_id: x,
// pendingTransactions: {$ne: t}} scans the whole collection: every update
// mongotx (or the tutorial's recipe) makes would cost O(collection size),
// where MongoDB looks the _id up and then checks the rest.  IdLookupIndex
// does what MongoDB does: it serves any query holding an _id condition the
// index can answer alone, and the collection still matches every document
// it returns against the whole query.

import java.io.InputStream;
import java.net.InetSocketAddress;
import java.util.List;
import java.util.concurrent.CountDownLatch;

import org.h2.mvstore.MVStore;

import de.bwaldvogel.mongo.MongoBackend;
import de.bwaldvogel.mongo.MongoServer;
import de.bwaldvogel.mongo.backend.h2.H2Backend;
import de.bwaldvogel.mongo.backend.CursorRegistry;
import de.bwaldvogel.mongo.backend.Index;
import de.bwaldvogel.mongo.backend.IndexKey;
import de.bwaldvogel.mongo.backend.memory.MemoryBackend;
import de.bwaldvogel.mongo.backend.memory.MemoryDatabase;
import de.bwaldvogel.mongo.backend.memory.index.MemoryUniqueIndex;
import de.bwaldvogel.mongo.bson.Document;
import io.netty.channel.Channel;

public final class MongoServerMain {

    /** A unique single-key index that also serves queries with more keys. */
    static final class IdLookupIndex extends MemoryUniqueIndex {
        private final String key;

        IdLookupIndex(String name, List<IndexKey> keys, boolean sparse) {
            super(name, keys, sparse);
            this.key = keys.size() == 1 ? keys.get(0).getKey() : null;
        }

        /** The query's condition on the key alone, or null. */
        private Document keyPart(Document query) {
            if (key == null || query.size() < 2 || !query.containsKey(key)) {
                return null;
            }
            Document part = new Document(key, query.get(key));
            return super.canHandle(part) ? part : null;
        }

        @Override
        public synchronized boolean canHandle(Document query) {
            return super.canHandle(query) || keyPart(query) != null;
        }

        @Override
        public synchronized Iterable<Integer> getPositions(Document query) {
            Document part = keyPart(query);
            return super.getPositions(part != null ? part : query);
        }
    }

    static final class IdLookupDatabase extends MemoryDatabase {
        IdLookupDatabase(String name, CursorRegistry cursors) {
            super(name, cursors);
        }

        @Override
        protected Index<Integer> openOrCreateUniqueIndex(String collection, String name,
                                                         List<IndexKey> keys, boolean sparse) {
            return new IdLookupIndex(name, keys, sparse);
        }
    }

    static final class IdLookupMemoryBackend extends MemoryBackend {
        @Override
        public MemoryDatabase openOrCreateDatabase(String name) {
            return new IdLookupDatabase(name, getCursorRegistry());
        }
    }

    static final class DurableH2Backend extends H2Backend {
        private final MVStore store;
        private final boolean fsync;

        DurableH2Backend(MVStore store, boolean fsync) {
            super(store);
            this.store = store;
            this.fsync = fsync;
        }

        @Override
        public Document handleCommand(Channel channel, String db, String command, Document query) {
            try {
                return super.handleCommand(channel, db, command, query);
            } finally {
                // runs before the caller encodes and sends the reply
                if (!store.isClosed() && store.hasUnsavedChanges()) {
                    store.commit();
                    if (fsync) {
                        store.sync();
                    }
                }
            }
        }
    }

    private static void usage(String msg) {
        System.err.println("MongoServerMain: " + msg);
        System.err.println("usage: MongoServerMain [--port N] [--durability commit|sync|background] memory|h2 FILE");
        System.exit(2);
    }

    public static void main(String[] args) {
        try {
            run(args);
        } catch (Throwable t) {
            // e.g. the port is taken: exit at once (netty's threads would
            // otherwise keep the JVM alive)
            t.printStackTrace();
            System.err.println("MongoServerMain: " + t);
            System.exit(1);
        }
    }

    private static void run(String[] args) throws Exception {
        int port = 0;
        String durability = "commit";
        String kind = null;
        String file = null;
        for (int i = 0; i < args.length; i++) {
            String a = args[i];
            if (a.equals("--port") && i + 1 < args.length) {
                port = Integer.parseInt(args[++i]);
            } else if (a.equals("--durability") && i + 1 < args.length) {
                durability = args[++i];
            } else if (kind == null) {
                kind = a;
            } else if (file == null) {
                file = a;
            } else {
                usage("unexpected argument " + a);
            }
        }
        if (kind == null) {
            usage("missing backend");
        }

        final MVStore store;
        final MongoBackend backend;
        switch (kind) {
            case "memory":
                store = null;
                backend = new IdLookupMemoryBackend();
                break;
            case "h2":
                if (file == null) {
                    usage("h2 needs a FILE");
                }
                store = new MVStore.Builder().fileName(file).open();
                switch (durability) {
                    case "commit":
                        backend = new DurableH2Backend(store, false);
                        break;
                    case "sync":
                        backend = new DurableH2Backend(store, true);
                        break;
                    case "background":
                        backend = new H2Backend(store);
                        break;
                    default:
                        usage("unknown durability " + durability);
                        return;
                }
                break;
            default:
                usage("unknown backend " + kind);
                return;
        }

        final MongoServer server = new MongoServer(backend);
        server.bind(new InetSocketAddress("127.0.0.1", port));
        final CountDownLatch done = new CountDownLatch(1);

        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            try {
                server.shutdownNow(); // also closes the backend (and MVStore)
            } catch (Throwable t) {
                t.printStackTrace();
            }
            if (store != null && !store.isClosed()) {
                store.close();
            }
            done.countDown();
        }, "shutdown"));

        Thread stdinWatch = new Thread(() -> {
            try {
                InputStream in = System.in;
                byte[] buf = new byte[256];
                while (in.read(buf) >= 0) {
                    // discard
                }
            } catch (Exception e) {
                // treat like EOF
            }
            System.exit(0); // runs the shutdown hook
        }, "stdin-watch");
        stdinWatch.setDaemon(true);
        stdinWatch.start();

        String version = MongoServer.class.getPackage().getImplementationVersion();
        System.out.println("PORT " + server.getLocalAddress().getPort());
        System.out.println("VERSION mongo-java-server " + (version != null ? version : "1.47.0"));
        System.out.flush();
        done.await();
    }
}
